"""Perceptual hashes and their neighbours.

The pHash of an image (Zauner 2010, "Implementation and Benchmarking of Perceptual Image Hash
Functions"; the ``phash`` of the imagehash library): its luma resized to 32x32, the 2-D DCT-II of
that, the 8x8 lowest frequencies, one bit each: above their median or not. Resizing, re-encoding
change few of the 64 bits; different photos differ in about half. A crop moves many more, so every
image is also hashed at nine 90% crops (:func:`crop_views`; offsets 0, 5% and 10% on each axis): a
copy cropped anywhere up to 10% is within a few bits of one of them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

HASH_SIDE = 32  # the luma is resized to HASH_SIDE x HASH_SIDE before the DCT
LOW = 8  # LOW x LOW lowest frequencies: a 64-bit hash
BITS = LOW * LOW
CROP = 0.9  # side of the crop views, as a fraction of the image's
OFFSETS = (0.0, 0.05, 0.1)  # their offsets on each axis
VIEWS = 1 + len(OFFSETS) ** 2  # the whole image, then the crops
VIEW_SIDE = 16  # px, the views kept for verifying a pair (:func:`view_correlation`)


def dct_matrix(n: int) -> torch.Tensor:
    """The DCT-II matrix ``float64 (n, n)`` without normalisation (``scipy.fftpack.dct``'s default, as
    imagehash uses it): ``D @ x`` is the DCT of the columns of ``x``."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    return 2 * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))


_DCT = dct_matrix(HASH_SIDE)
_WEIGHTS = torch.tensor([1 << b for b in range(BITS)], dtype=torch.float64)


def phash(gray: torch.Tensor) -> np.ndarray:
    """``float (B, 32, 32)`` luma images -> ``uint64 (B,)`` pHashes (bit ``r*8+c`` is frequency ``(r, c)``)."""
    coeffs = (_DCT @ gray.double() @ _DCT.T)[:, :LOW, :LOW].reshape(len(gray), BITS)
    coeffs = coeffs.numpy()
    bits = coeffs > np.median(coeffs, axis=1, keepdims=True)
    return np.packbits(bits, axis=1, bitorder="little").view("<u8").reshape(-1).astype(np.uint64)


def crop_views(luma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``float (R, R)`` luma -> ``(float (VIEWS, 32, 32) for hashing, float (VIEWS, 16, 16) kept)``: the
    whole image, then its 90% crops at :data:`OFFSETS`, each resized (bilinear, antialiased)."""
    r = luma.shape[-1]
    c = int(round(CROP * r))
    crops = [luma] + [luma[int(round(oy * r)):int(round(oy * r)) + c, int(round(ox * r)):int(round(ox * r)) + c]
                      for oy in OFFSETS for ox in OFFSETS]
    def resized(side: int) -> torch.Tensor:
        return torch.cat([F.interpolate(v[None, None], size=(side, side), mode="bilinear", antialias=True,
                                        align_corners=False)[0] for v in crops])
    return resized(HASH_SIDE), resized(VIEW_SIDE)


def _z(v: np.ndarray) -> np.ndarray:
    v = v.reshape(*v.shape[:2], -1).astype(np.float32)
    v = v - v.mean(-1, keepdims=True)
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-6)


def view_correlation(a: np.ndarray, b: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """How alike the pixels of pairs of images are, whichever of each pair is the cropped one: the
    largest Pearson correlation between the whole of one and a view (whole or crop) of the other.

    Args:
        a, b: ``uint8 (P, VIEWS, 16, 16)`` views (:func:`crop_views`) of the pairs' two images.
    Returns:
        ``float32 (P,)`` in [-1, 1]: near 1 for a copy (resized, re-encoded, cropped up to 10%);
        look-alike photos stay lower.
    """
    out = np.zeros(len(a), np.float32)
    for s in range(0, len(a), chunk):
        za, zb = _z(a[s:s + chunk]), _z(b[s:s + chunk])
        out[s:s + chunk] = np.maximum((za[:, :1] * zb).sum(-1).max(-1), (za * zb[:, :1]).sum(-1).max(-1))
    return out


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bits that differ between ``uint64`` hashes ``a`` and ``b`` (broadcast) -> ``int (..)``."""
    x = np.atleast_1d(np.bitwise_xor(np.asarray(a, np.uint64), np.asarray(b, np.uint64)))
    return np.unpackbits(x.view(np.uint8).reshape(*x.shape, 8), axis=-1).sum(-1)


def hash_neighbours(queries: np.ndarray, bank: np.ndarray, k: int, max_distance: int) -> list[tuple[int, int, int]]:
    """Pairs ``(query row, bank row, distance)`` whose pHashes differ in at most ``max_distance`` bits,
    among the ``k`` nearest bank rows of each query (faiss ``IndexBinaryFlat``: exact Hamming k-NN in
    ``O(N k)`` memory; no ``N x N`` matrix)."""
    from vitflow.quality.neighbors import faiss

    if not len(queries) or not len(bank):
        return []
    index = faiss().IndexBinaryFlat(BITS)
    index.add(np.ascontiguousarray(bank.view(np.uint8).reshape(-1, 8)))
    dist, nn = index.search(np.ascontiguousarray(queries.view(np.uint8).reshape(-1, 8)), min(k, len(bank)))
    return [(q, int(j), int(d)) for q, (row, drow) in enumerate(zip(nn, dist)) for j, d in zip(row, drow)
            if j >= 0 and d <= max_distance]
