"""Images that do not belong, and splits that cannot teach: far-from-everything images, broken,
tiny, extremely elongated and near-constant (blank, very dark, very bright) images, classes with
too few images and heavy imbalance.

The outlier score of an image is its mean cosine distance to its :data:`OUTLIER_K` nearest
training images (a k-NN distance, Ramaswamy et al. 2000); an image is flagged when the score's
modified z-score (Iglewicz & Hoaglin 1993: ``0.6745 (x - median) / MAD``) over the training images
exceeds :data:`OUTLIER_Z`.
"""

from __future__ import annotations

import numpy as np

from vitflow.quality.neighbors import cosine_knn
from vitflow.quality.scan import SplitScan

OUTLIER_K = 10
OUTLIER_Z = 3.5  # Iglewicz & Hoaglin's cut-off for the modified z-score
TINY_SIDE = 16  # px: a shorter side below this holds too little to classify
TINY_FRACTION = 0.25  # ... or below this fraction of the data's median shorter side
MAX_ASPECT = 4.0  # longer side / shorter side
BLANK_CONTRAST = 6.0  # luma standard deviation (0..255) of a near-constant image
DARK, BRIGHT = 25.0, 230.0  # mean luma (0..255) of a near-constant image called dark / bright
MIN_CLASS_IMAGES = 10  # a class with fewer training images
MAX_IMBALANCE = 10.0  # largest class / smallest class


def outlier_scores(scans: list[SplitScan], train: SplitScan) -> dict[str, np.ndarray]:
    """``split -> float32 (N,)`` mean cosine distance of each image to its nearest training images
    (itself left out); ``nan`` for unreadable images and without embeddings."""
    out = {}
    bank_rows = np.flatnonzero(train.readable)
    for s in scans:
        score = np.full(len(s), np.nan, np.float32)
        if s.features is not None and train.features is not None and len(bank_rows) > 1:
            rows = np.flatnonzero(s.readable)
            sim, nn = cosine_knn(s.features[rows], train.features[bank_rows], OUTLIER_K, same=s is train)
            score[rows] = 1 - np.where(nn >= 0, sim, np.nan).mean(1) if sim.shape[1] else np.nan
        out[s.split] = score
    return out


def outlier_cut(train_scores: np.ndarray) -> float:
    """The score above which an image is an outlier: modified z-score > :data:`OUTLIER_Z` over
    the training images (``inf`` when they do not vary)."""
    x = train_scores[np.isfinite(train_scores)]
    if len(x) < 3:
        return float("inf")
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    return med + OUTLIER_Z * mad / 0.6745 if mad > 0 else float("inf")


def image_faults(s: SplitScan, median_side: float) -> list[tuple[int, str, float, str]]:
    """``(row, finding, score 0..1, detail)`` for broken, tiny, elongated and near-constant images."""
    out = []
    for i in range(len(s)):
        if s.error[i]:
            out.append((i, "broken", 1.0, s.error[i]))
            continue
        w, h = int(s.width[i]), int(s.height[i])
        short, long = min(w, h), max(w, h)
        if short < max(TINY_SIDE, TINY_FRACTION * median_side):
            out.append((i, "tiny", 1 - short / max(median_side, 1), f"{w}x{h} px (median shorter side "
                        f"{median_side:.0f} px)"))
        if long / max(short, 1) > MAX_ASPECT:
            out.append((i, "extreme_aspect", min(1.0, long / short / (4 * MAX_ASPECT)), f"{w}x{h} px"))
        if s.contrast[i] < BLANK_CONTRAST:
            b = float(s.brightness[i])
            what = "dark" if b < DARK else "bright" if b > BRIGHT else "blank"
            out.append((i, "near_constant", 1 - float(s.contrast[i]) / BLANK_CONTRAST,
                        f"{what}: mean luma {b:.0f}, standard deviation {float(s.contrast[i]):.1f} (0..255)"))
    return out


def class_faults(train: SplitScan) -> list[tuple[str, str, float, str]]:
    """``(class, finding, score, detail)``: classes with too few training images, heavy imbalance."""
    labels = train.labels[train.readable]
    if labels.ndim != 1:
        return []
    counts = np.bincount(labels, minlength=len(train.classes))
    out = [(c, "small_class", 1 - n / MIN_CLASS_IMAGES, f"{n} training image(s); at least {MIN_CLASS_IMAGES} "
            "are needed to learn a class and to score it") for c, n in zip(train.classes, counts) if n < MIN_CLASS_IMAGES]
    if counts.min(initial=0) > 0 and counts.max() / counts.min() > MAX_IMBALANCE:
        lo, hi = int(counts.argmin()), int(counts.argmax())
        out.append((train.classes[lo], "imbalance", min(1.0, counts.max() / counts.min() / 100),
                    f"{train.classes[hi]} has {counts.max()} training images, {train.classes[lo]} {counts.min()} "
                    f"({counts.max() / counts.min():.0f}x): consider data.sampler=balanced"))
    return out
