"""Exact copies, near-copies and leaks across splits.

- exact copies: the same encoded bytes (SHA-1 of the file; decoded pixels for in-memory data);
- near-copies: candidates are pairs whose pHashes (:mod:`vitflow.quality.phash`, the whole image
  against the whole and the 90% crops of the other) are within :data:`PHASH_CANDIDATE` bits, or
  the nearest embeddings by cosine; a candidate is a copy when the pixels of the two agree
  (:func:`~vitflow.quality.phash.view_correlation` at least :data:`VIEW_CORRELATION_MIN`, or at least
  :data:`CLOSE_CORRELATION_MIN` when the hashes are within :data:`CLOSE_BITS`, both raised where the
  data's images all look alike: :func:`data_cuts`), so a weak model's embeddings or a look-alike
  photo do not make copies;
- a pair in two different splits is a **leak**: a test image whose copy is in train inflates the
  test figure.

Candidates come from k-NN searches (faiss), never from all pairs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from vitflow.quality.neighbors import cosine_knn
from vitflow.quality.phash import BITS, hamming, hash_neighbours, view_correlation
from vitflow.quality.scan import SplitScan

log = logging.getLogger(__name__)
FLAT_CONTRAST = 12.0  # luma standard deviation (0..255) under which an image is only matched byte for byte: the
# pixels of flat images (water from a satellite, a blank page) correlate by their noise, looked at on EuroSAT
PHASH_CANDIDATE = 12  # bits of 64
VIEW_CORRELATION_MIN = 0.92  # pixels' correlation of a near-copy (a 90%-crop, 0.6x, JPEG-q60 copy: >= 0.923)
CLOSE_BITS, CLOSE_CORRELATION_MIN = 6, 0.8  # hashes this close need less agreement of the pixels
# a copy's 1 - correlation is at most this share of the data's median nearest-candidate one (data_cuts). The
# median nearest-candidate correlation measured: eurosat 0.43, hymenoptera 0.50, CIFAR-10 0.63, clothing 0.85,
# malaria 0.955; the cuts it gives: 0.92 for the first three, 0.963 and 0.989 for the last two
MEDIAN_SHARE = 0.25
# above this median, unrelated images correlate like copies (cells on a slide: 0.955, clothes on one backdrop: 0.85;
# looked at, their flagged pairs were mostly different items): near-copies there are for review
HOMOGENEOUS_MEDIAN = 0.8
NEIGHBOURS = 8  # candidates looked at per image (each of its hash views; its embedding)


@dataclass(frozen=True)
class Pair:
    """Two images that are copies: ``(split, row)`` each, ``kind`` ``exact`` or ``near``, the pHash
    distance in bits (whole to nearest view), the pixels' correlation and the embedding cosine
    (``nan`` without embeddings)."""

    a: tuple[str, int]
    b: tuple[str, int]
    kind: str
    phash_bits: int
    correlation: float
    cosine: float
    sure: bool = True  # False: a near-copy in data whose images all look alike at low resolution (to review)

    @property
    def leak(self) -> bool:
        return self.a[0] != self.b[0]


def _candidates(hashes: np.ndarray, emb: np.ndarray | None) -> set[tuple[int, int]]:
    views = hashes.shape[1]
    pairs = {(min(q, r // views), max(q, r // views)) for q, r, _ in
             hash_neighbours(np.ascontiguousarray(hashes[:, 0]), hashes.reshape(-1), NEIGHBOURS * 2, PHASH_CANDIDATE)
             if r // views != q}
    if emb is not None:
        _, nn = cosine_knn(emb, emb, NEIGHBOURS, same=True)
        pairs |= {(min(a, int(b)), max(a, int(b))) for a in range(len(emb)) for b in nn[a] if b >= 0}
    return pairs


def find_copies(scans: list[SplitScan], correlation_min: float = VIEW_CORRELATION_MIN) -> list[Pair]:
    """Every pair of copies among the readable images of ``scans``, each pair once, exact copies
    first, then by the pixels' correlation (highest first)."""
    by = {s.split: s for s in scans}
    pick = {s.split: np.flatnonzero(s.readable) for s in scans}
    rows = [(split, int(i)) for split, idx in pick.items() for i in idx]
    if len(rows) < 2:
        return []
    hashes = np.concatenate([by[s].phash[pick[s]] for s in by])
    views = np.concatenate([by[s].views[pick[s]] for s in by])
    sha = [by[s].sha1[i] for s, i in rows]
    emb = np.concatenate([by[s].features[pick[s]] for s in by]) if all(
        s.features is not None for s in scans) else None
    cand = sorted(_candidates(hashes, emb) | _same_bytes(sha))
    if not cand:
        return []
    a, b = np.array(cand).T
    corr = view_correlation(views[a], views[b])
    bits = np.minimum(hamming(hashes[a, :1], hashes[b]).min(-1), hamming(hashes[a], hashes[b, :1]).min(-1))
    cos = np.full(len(a), np.nan, np.float32)
    if emb is not None:
        e = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        cos = (e[a] * e[b]).sum(1)
    ref = np.array([(q, r) for q, r, _ in hash_neighbours(np.ascontiguousarray(hashes[:, 0]),
                                                          np.ascontiguousarray(hashes[:, 0]), 2, BITS) if q != r])
    ra, rb = (ref[:, 0], ref[:, 1]) if len(ref) else (a[:0], b[:0])  # every image's nearest, however far
    cut, close_cut, median = data_cuts(np.concatenate([corr, view_correlation(views[ra], views[rb])]),
                                       np.concatenate([a, ra]), np.concatenate([b, rb]), len(rows), correlation_min)
    flat = np.concatenate([by[s].contrast[pick[s]] for s in by]) < FLAT_CONTRAST  # correlation of noise: exact only
    sure = median <= HOMOGENEOUS_MEDIAN
    if not sure:
        log.warning("the images of this data look alike at low resolution (median correlation of nearest images %.3f): "
                    "near-copies are reported for review, not dropped by exclude.txt", median)
    pairs = [Pair(rows[i], rows[j], "exact" if sha[i] == sha[j] else "near", int(d), float(c), float(co),
                  sure or sha[i] == sha[j])
             for i, j, d, c, co in zip(a, b, bits, corr, cos)
             if sha[i] == sha[j] or (not flat[i] and not flat[j] and (c >= cut or (d <= CLOSE_BITS and c >= close_cut)))]
    return sorted(pairs, key=lambda p: (p.kind != "exact", -p.correlation))


def data_cuts(corr: np.ndarray, a: np.ndarray, b: np.ndarray, n: int, correlation_min: float = VIEW_CORRELATION_MIN
              ) -> tuple[float, float, float]:
    """The correlations a near-copy needs in this data: ``(cut, cut within CLOSE_BITS, the median
    nearest-candidate correlation)``.

    Where every image looks like its neighbours (cells on a slide, products on white), unrelated
    images correlate at 0.95; a copy must stand out of its data. A copy's distance ``1 - correlation``
    must be at most :data:`MEDIAN_SHARE` of the data's median nearest-candidate distance (each image's
    closest among its candidates and its nearest pHash, however far; the median, so that up to half
    the images may be copies), and never below the fixed cuts.
    """
    best = np.full(n, -1.0, np.float32)
    np.maximum.at(best, a, corr)
    np.maximum.at(best, b, corr)
    median = float(np.median(best[best > -1])) if (best > -1).any() else 0.0
    return (max(correlation_min, 1 - (1 - median) * MEDIAN_SHARE),
            max(CLOSE_CORRELATION_MIN, 1 - (1 - median) * 2 * MEDIAN_SHARE), median)


def _same_bytes(sha: list[str]) -> set[tuple[int, int]]:
    """Pairs of rows with the same digest: each row with the first of its group."""
    first: dict[str, int] = {}
    out = set()
    for i, d in enumerate(sha):
        if d in first:
            out.add((first[d], i))
        else:
            first[d] = i
    return out
