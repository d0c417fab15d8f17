"""``vitflow inspect`` without the training: open every split, scan it (:mod:`.scan`, cached), and
turn the scans and out-of-sample probabilities into findings (:mod:`.findings`).

The k-fold training path lives in the Python API (:func:`vitflow.api.inspect.inspect`), which hands
its out-of-fold probabilities in here: this package reads a model through ``infer`` and never
trains one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from vitflow.config import DataConfig
from vitflow.data import open_split
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.dispatch import split_names
from vitflow.infer.features.backbone import Backbone
from vitflow.quality.duplicates import find_copies
from vitflow.quality.labels import probe_probabilities, rank_label_issues
from vitflow.quality.outliers import class_faults, image_faults, outlier_cut, outlier_scores
from vitflow.quality.scan import NUMERIC, SplitScan, scan_split

log = logging.getLogger(__name__)
# a training image's label issue goes to exclude.txt when the out-of-sample probability of its given class is
# below this share of the uniform one (1 / classes); the other label issues, and every one of a held-out split
# (what the user scores on changes only by their hand), are for review. On 20%-noisy CIFAR-10 with a 4-minute
# model, the excluded ones were 74% flipped labels (all flagged: 39%)
DROP_LABEL_SHARE = 0.5
# one line when the share of training images the probes flag is below this fraction of the held-out splits'
# share: the model trained on these images and its embeddings carry their given labels (wrong ones too), so the
# training split's label issues are under-found. Training share / held-out share, measured with 5-minute runs:
# 0.65-1.1 on six suite folders, 0.23 on UC Merced, 0.05 on hymenoptera (hundreds of epochs), 0.08 for one of
# three 4-minute CIFAR-10 runs on 20%-flipped labels (116 of 600 flipped found against ~1,140 by the others)
FITTED_LABELS_RATIO = 0.5
COMMON_FAULT_SHARE = 0.2  # an image fault shared by more of a class's training images is how the class looks


def open_splits(dcfg: DataConfig) -> list[tuple[str, ImageSource]]:
    """``(split, source)`` of every split of the data, the training split first, all labelled with its
    classes. Raises DataError: no images, or fewer than two classes."""
    train = open_split(dcfg.path, dcfg.train_split, dcfg.source, cfg=dcfg)
    if len(train) == 0:
        raise DataError(f"{dcfg.path}: split {dcfg.train_split!r} holds no images")
    if len(train.classes) < 2:
        raise DataError(f"{dcfg.path}: one class ({train.classes[0] if train.classes else 'none'}) in split "
                        f"{dcfg.train_split!r}; inspecting labels needs at least two class folders or label values")
    out = [(dcfg.train_split, train)]
    for name in split_names(dcfg.path, dcfg.source, dcfg):
        if name != dcfg.train_split.split("[")[0]:
            out.append((name, open_split(dcfg.path, name, dcfg.source, classes=list(train.classes), cfg=dcfg)))
    return out


def _digest(split: str, source: ImageSource, backbone: Backbone | None) -> str:
    model = None
    if backbone is not None:
        p = Path(backbone.source)
        stat = p.stat() if p.exists() else None
        model = [str(p.resolve()) if stat else backbone.source, stat and stat.st_mtime_ns, stat and stat.st_size,
                 backbone.name, vars(backbone.preprocess) if hasattr(backbone.preprocess, "__dict__") else
                 str(backbone.preprocess)]
    keys = [source.name(i) for i in range(len(source))]
    return hashlib.sha1(json.dumps([split, model, keys, np.asarray(source.labels).tolist()], default=str)
                        .encode("utf-8", "surrogateescape")).hexdigest()[:16]


def cached_scan(split: str, source: ImageSource, backbone: Backbone | None, cache_dir: Path | None,
                workers: int = 2) -> SplitScan:
    """:func:`~vitflow.quality.scan.scan_split`, kept in ``cache_dir`` as ``scan-<split>-<digest>.npz``
    (the digest covers the model file, its preprocessing and the split's images and labels)."""
    path = cache_dir / f"scan-{split}-{_digest(split, source, backbone)}.npz" if cache_dir else None
    if path is not None and path.is_file():
        z = np.load(path, allow_pickle=False)
        log.info("split %r: scan read from %s", split, path)
        s = SplitScan(split, list(source.classes), [str(k) for k in z["keys"]], [source.name(i) for i in
                      range(len(source))], z["labels"])
        for k in NUMERIC:
            setattr(s, k, z[k])
        s.sha1, s.error = [str(x) for x in z["sha1"]], [str(x) for x in z["error"]]
        s.features = z["features"] if "features" in z else None
        return s
    s = scan_split(source, split, backbone, workers=workers)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.npz")
        np.savez(tmp, **s.arrays())
        os.replace(tmp, path)
    return s


def _row(s: SplitScan, i: int, finding: str, score: float, detail: str, **more) -> dict:
    label = s.classes[int(s.labels[i])] if s.labels.ndim == 1 else ""
    return {"finding": finding, "score": round(float(score), 4), "split": s.split, "key": s.keys[i],
            "path": s.names[i], "label": label, "detail": detail, **more}


def label_rows(scans: list[SplitScan], probs: dict[str, np.ndarray] | None, label_cut: float | None = None
               ) -> list[dict]:
    """Label issues of every split: ``probs`` (split -> out-of-sample ``(N, C)``) or, without them,
    linear probes on the scans' features. No features and no probs: none. A training image's issue
    is for exclude.txt when its given class's probability is below ``label_cut`` (default
    ``DROP_LABEL_SHARE / classes``; 1: every issue confident learning flags)."""
    train = scans[0]
    if train.labels.ndim != 1:
        log.warning("label issues are found for single-label data; this data is multi-label: leaks, copies and "
                    "outliers only")
        return []
    probed = probs is None
    if probed:
        if train.features is None:
            return []
        ok = [s.readable for s in scans]
        oof, rest = probe_probabilities(train.features[ok[0]], train.labels[ok[0]], len(train.classes),
                                        [s.features[m] for s, m in zip(scans[1:], ok[1:])])
        probs = {}
        for s, m, p in zip(scans, ok, [oof, *rest]):
            full = np.full((len(s), len(train.classes)), 1 / len(train.classes), np.float32)
            full[m] = p
            probs[s.split] = full
    rows, counts = [], {}
    for s in scans:
        ok = np.flatnonzero(s.readable)
        if s.split not in probs or len(ok) < 2:
            continue
        flagged, quality, suggested = rank_label_issues(s.labels[ok], probs[s.split][ok])
        counts[s.split] = (len(flagged), len(ok))
        sure = _drop_below(len(s.classes), label_cut)
        for r, q, c in zip(flagged, quality, suggested):
            i = int(ok[r])
            action = "exclude" if s is train and q < sure else "review"
            rows.append(_row(s, i, "label_issue", 1 - q, f"given {s.classes[int(s.labels[i])]} ({q:.0%}), the model "
                             f"says {s.classes[c]} ({probs[s.split][i, c]:.0%})", suggested=s.classes[c], action=action))
    if probed:
        _say_fitted_labels(counts, train.split)
    return rows


def _drop_below(classes: int, label_cut: float | None) -> float:
    """The given class's probability under which a flagged training label goes to exclude.txt."""
    return DROP_LABEL_SHARE / classes if label_cut is None else label_cut


def _say_fitted_labels(counts: dict[str, tuple[int, int]], train: str) -> None:
    """One line when the probes flag far fewer training images than held-out ones (``counts``: split ->
    ``(flagged, scored)``): the embeddings were fitted to the training labels (:data:`FITTED_LABELS_RATIO`)."""
    held = [c for split, c in counts.items() if split != train]
    if train not in counts or not held or sum(n for _, n in held) == 0:
        return
    trained, held_share = counts[train][0] / counts[train][1], sum(f for f, _ in held) / sum(n for _, n in held)
    if trained < FITTED_LABELS_RATIO * held_share:
        log.warning("label issues: the probes flag %.1f%% of the training images but %.1f%% of the held-out ones: "
                    "the model trained on these images and its embeddings carry their given labels, wrong ones too, "
                    "so the training split's label issues are under-found; without --model, vitflow inspect scores "
                    "each image by a model that never trained on it (k-fold)", 100 * trained, 100 * held_share)


def copy_rows(scans: list[SplitScan]) -> list[dict]:
    """Leaks, exact and near copies (:func:`~vitflow.quality.duplicates.find_copies`). A leak's row
    is the image outside the held-out split (the training copy) so dropping it keeps the test set whole."""
    by = {s.split: s for s in scans}
    order = {s.split: k for k, s in enumerate(scans)}
    rows = []
    for p in find_copies(scans):
        first, second = sorted([p.a, p.b], key=lambda t: (order[t[0]], t[1]))
        kind = "leak" if p.leak else f"{p.kind}_duplicate"
        # a leak keeps the held-out copy (the row, and the fix, is the training-side image); within a split the
        # later copy goes
        (sa, a), (sb, b) = (first, second) if p.leak and order[first[0]] == 0 else (second, first)
        s, o = by[sa], by[sb]
        score = 1.0 if p.kind == "exact" else p.correlation
        detail = "identical files" if p.kind == "exact" else (
            f"pixels' correlation {p.correlation:.3f}, pHash {p.phash_bits} bits apart"
            + ("" if np.isnan(p.cosine) else f", embedding cosine {p.cosine:.3f}"))
        rows.append(_row(s, a, kind, score, detail, other_split=o.split, other_key=o.keys[b], other_path=o.names[b],
                         **({} if p.sure else {"action": "review"})))
    return rows


def _common_faults(train: SplitScan, faults: list[tuple[int, str, float, str]]) -> set[tuple[str, str]]:
    """``(fault, class)`` pairs that are how a class looks, not faults: more than :data:`COMMON_FAULT_SHARE`
    of the class's training images have it (the sea tiles of a satellite set are near-constant)."""
    if train.labels.ndim != 1:
        return set()
    counts = np.bincount(train.labels, minlength=len(train.classes))
    hits: dict[tuple[str, int], int] = {}
    for i, k, _, _ in faults:
        hits[(k, int(train.labels[i]))] = hits.get((k, int(train.labels[i])), 0) + 1
    common = {(k, train.classes[c]) for (k, c), n in hits.items() if n > COMMON_FAULT_SHARE * counts[c]}
    for k, c in sorted(common):
        log.info("%s: a common look of class %s in this data (over %.0f%% of its training images), not reported",
                 k, c, 100 * COMMON_FAULT_SHARE)
    return common


def fault_rows(scans: list[SplitScan]) -> list[dict]:
    """Broken, tiny, elongated, near-constant, outlying images; small classes and imbalance."""
    train = scans[0]
    sides = np.minimum(train.width, train.height)[train.readable]
    median_side = float(np.median(sides)) if len(sides) else 0.0
    faults = {s.split: image_faults(s, median_side) for s in scans}
    common = _common_faults(train, faults[train.split])
    rows = [_row(s, i, k, sc, d) for s in scans for i, k, sc, d in faults[s.split]
            if s.labels.ndim != 1 or (k, s.classes[int(s.labels[i])]) not in common]
    scores = outlier_scores(scans, train)
    cut = outlier_cut(scores[train.split])
    for s in scans:
        for i in np.flatnonzero(scores[s.split] > cut):
            rows.append(_row(s, int(i), "outlier", min(1.0, float(scores[s.split][i])),
                             f"mean cosine distance {scores[s.split][i]:.3f} to its nearest training images "
                             f"(the cut: {cut:.3f})"))
    for c, k, sc, d in class_faults(train):
        rows.append({"finding": k, "score": round(sc, 4), "split": train.split, "label": c, "detail": d})
    return rows


MARK = "vitflow_inspect"  # the key of summary.json that says the folder is an inspect's output


def check_output(out: Path) -> None:
    """Refuse to write into anything but a new or empty folder or an earlier ``vitflow inspect``'s
    (its ``summary.json`` carries :data:`MARK`). Raises FileExistsError naming it."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"-o {out}: is a file; give a new or empty folder")
    names = {p.name for p in out.iterdir()}
    if names <= {"cache", "kfold"}:
        return
    try:
        ours = MARK in json.loads((out / "summary.json").read_text())
    except (OSError, ValueError, TypeError):
        ours = False
    if not ours:
        raise FileExistsError(f"-o {out}: holds files that are not an earlier vitflow inspect's; give a new or "
                              "empty folder")


def inspect_data(dcfg: DataConfig, out: str | Path, backbone: Backbone | None = None,
                 probs: dict[str, np.ndarray] | None = None, cache_dir: str | Path | None = None,
                 workers: int = 2, extra: dict | None = None,
                 sources: list[tuple[str, ImageSource]] | None = None, label_cut: float | None = None):
    """Every finding of the data ``dcfg`` names, written to ``out`` (:func:`~vitflow.quality.findings.write_findings`
    and ``index.html``).

    Args:
        backbone: the model whose embeddings find near-copies and outliers (and feed the label probes).
        probs: out-of-sample class probabilities per split (k-fold training); without them, probes on
            the embeddings.
        cache_dir: where scans are kept between runs (default: ``out/cache``).
        extra: more lines for the summary (how the probabilities were made).
        sources: the splits :func:`open_splits` opened for ``dcfg`` (default: opened here).
        label_cut: a training label issue whose given class is below this probability goes to
            exclude.txt (:func:`label_rows`).
    Returns:
        ``(findings DataFrame, summary dict, files dict)``.
    Raises:
        DataError: no images, one class, unreadable splits; FileExistsError: ``out`` is a folder of
        something else. Nothing is written before the scans succeed.
    """
    from vitflow.quality.findings import KINDS, frame, write_findings
    from vitflow.quality.page import write_page

    t0 = time.perf_counter()
    out = Path(out)
    check_output(out)
    sources = sources or open_splits(dcfg)
    cache = Path(cache_dir) if cache_dir else out / "cache"
    scans = [cached_scan(name, src, backbone, cache, workers) for name, src in sources]
    if not scans[0].readable.any():
        raise DataError(f"{dcfg.path}: none of the {len(scans[0])} images of split {scans[0].split!r} can be read")
    df = frame(label_rows(scans, probs, label_cut) + copy_rows(scans) + fault_rows(scans))
    default = df["finding"].map({k: a for k, (_, a) in KINDS.items()})
    df["action"] = df["action"].where(df["action"] != "", default)
    df.loc[(df["split"] != scans[0].split) & (df["action"] == "exclude"), "action"] = "review"  # held-out: by hand
    summary = {MARK: 1, "data": str(dcfg.path), "model": backbone.source if backbone else "none",
               **(extra or {}), "label_cut": round(_drop_below(len(scans[0].classes), label_cut), 4),
               "images": {s.split: len(s) for s in scans},
               "findings": {k: int((df["finding"] == k).sum()) for k in KINDS if (df["finding"] == k).any()},
               "seconds": round(time.perf_counter() - t0, 1)}
    files = write_findings(df, out, summary)
    files["page"] = str(write_page(df, summary, dict(sources), out, f"vitflow inspect: {dcfg.path}"))
    return df, summary, files
