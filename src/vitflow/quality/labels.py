"""Images whose given label is likely wrong: out-of-sample class probabilities for every image,
then confident learning (Northcutt et al. 2021, "Confident Learning: Estimating Uncertainty in
Dataset Labels", through cleanlab's ``find_label_issues``) to rank them.

Out-of-sample probabilities come either from k-fold training (:mod:`vitflow.quality.kfold`) or,
given embeddings, from a linear probe (multinomial logistic regression) cross-validated over the
training split: each training image is scored by a probe that never saw it, each held-out image
(validation, test) by the probe fitted on all of the training split.
"""

from __future__ import annotations

import warnings

import numpy as np

from vitflow.quality.neighbors import normalized

FOLDS = 5
PROBE_C = 10.0  # inverse L2 strength of the probe, on unit-norm features


def _probe():
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=PROBE_C, max_iter=2000)


def probe_probabilities(train_x: np.ndarray, train_y: np.ndarray, num_classes: int, held_out: list[np.ndarray],
                        folds: int = FOLDS, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """Out-of-sample probabilities from linear probes on embeddings.

    Args:
        train_x: ``float32 (N, D)`` training features; ``train_y``: ``int64 (N,)`` their labels.
        held_out: features ``(M_j, D)`` of other splits, scored by the probe fitted on all of train.
        folds: the k of the stratified k-fold (lowered to the smallest class's size, at least 2).
    Returns:
        ``(float32 (N, C) out-of-fold probabilities of train, [float32 (M_j, C)])``.
    Raises:
        ValueError: fewer than two classes in ``train_y``.
    """
    from sklearn.model_selection import StratifiedKFold

    present = np.unique(train_y)
    if len(present) < 2:
        raise ValueError("label issues need at least two classes in the training split")
    x = normalized(train_x)
    counts = np.bincount(train_y, minlength=num_classes)[present]
    k = max(2, min(folds, int(counts.min())))
    oof = np.zeros((len(x), num_classes), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a class smaller than k: StratifiedKFold says so; it still splits
        for fit, score in StratifiedKFold(k, shuffle=True, random_state=seed).split(x, train_y):
            oof[score] = _fitted_probs(x[fit], train_y[fit], x[score], num_classes)
        rest = [_fitted_probs(x, train_y, normalized(h), num_classes) if len(h) else np.zeros((0, num_classes),
                np.float32) for h in held_out]
    return oof, rest


def _fitted_probs(x: np.ndarray, y: np.ndarray, q: np.ndarray, num_classes: int) -> np.ndarray:
    out = np.zeros((len(q), num_classes), np.float32)
    seen = np.unique(y)
    if len(seen) == 1:  # a fold with one class only: it says that class
        out[:, seen[0]] = 1
        return out
    out[:, seen] = _probe().fit(x, y).predict_proba(q)
    return out


def rank_label_issues(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Confident learning over ``labels`` ``int64 (N,)`` and out-of-sample ``probs`` ``float (N, C)``.

    Returns:
        ``(rows flagged, worst first; their label-quality scores 0..1 (self-confidence, lower is
        worse); suggested class int64 (argmax of probs))`` for the flagged rows.
    """
    from cleanlab.filter import find_label_issues
    from cleanlab.rank import get_label_quality_scores

    if len(labels) < 2 or len(np.unique(labels)) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
    p = np.clip(probs.astype(np.float64), 1e-6, None)
    p /= p.sum(1, keepdims=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # classes with no predictions: cleanlab warns per class
        rows = np.asarray(find_label_issues(labels, p, return_indices_ranked_by="self_confidence"), dtype=np.int64)
        quality = get_label_quality_scores(labels, p, method="self_confidence")
    return rows, quality[rows].astype(np.float32), p[rows].argmax(1).astype(np.int64)
