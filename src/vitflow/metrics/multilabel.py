"""Multi-label classification metrics: per-class average precision, mAP, micro/macro F1 and the
choice of a global decision threshold.

Every function takes ``(n, C)`` arrays (NumPy arrays or CPU/GPU torch tensors, converted with
:func:`_as_numpy`), one row per example and one column per label, and follows scikit-learn's
definitions (``sklearn.metrics.average_precision_score``, ``f1_score``, ``precision_score``,
``recall_score``) so that the numbers can be checked against it; the implementation is our own and
does not import scikit-learn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DEFAULT_THRESHOLD_GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05, 0.10, ..., 0.95
_BLOCK_ELEMENTS = 1 << 23  # elements sorted at once: bounds the temporary copies to tens of MB


def _as_numpy(x: Any) -> np.ndarray:
    """A NumPy view/copy of ``x``; torch tensors are detached and moved to the CPU (bfloat16/float16
    become float32, which NumPy lacks or handles poorly)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.is_floating_point() and x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def _check_scores(scores: Any, name: str) -> np.ndarray:
    s = _as_numpy(scores)
    if s.ndim != 2 or s.size == 0:
        raise ValueError(f"{name} must be a non-empty 2-D (n, C) array, got shape {s.shape}")
    if s.dtype == np.bool_ or not np.issubdtype(s.dtype, np.number):
        raise ValueError(f"{name} must be numeric, got dtype {s.dtype}")
    if not np.issubdtype(s.dtype, np.floating):
        s = s.astype(np.float64)
    if not np.isfinite(s).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return s


def _check_binary(values: Any, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    v = _as_numpy(values)
    if v.ndim != 2 or v.size == 0:
        raise ValueError(f"{name} must be a non-empty 2-D (n, C) array, got shape {v.shape}")
    if shape is not None and v.shape != shape:
        raise ValueError(f"{name} has shape {v.shape}, expected {shape}")
    if v.dtype != np.bool_:
        if not ((v == 0) | (v == 1)).all():
            raise ValueError(f"{name} must contain only 0 and 1 (multi-hot labels)")
        v = v == 1
    return v


def average_precision(scores: Any, targets: Any) -> np.ndarray:
    """Per-class average precision, as ``sklearn.metrics.average_precision_score(targets[:, c],
    scores[:, c])`` computes it.

    ``AP = sum_k (R_k - R_{k-1}) P_k`` over the distinct score thresholds taken in decreasing
    order, where ``P_k``/``R_k`` are the precision/recall of predicting every example whose score is
    ``>=`` the k-th threshold (``R_0 = 0``). Tied scores form one threshold, so they enter together,
    as in sklearn. Equivalently, AP is the mean over the positive examples ``j`` of
    ``#{positives with score >= s_j} / #{examples with score >= s_j}``, which is what is computed:
    one vectorised sort per class plus binary searches. No interpolation is applied (this is not the
    11-point VOC AP).

    Args:
        scores: float ``(n, C)``, higher means more likely (logits or probabilities: AP only depends
            on the order, but note that probabilities saturated to exactly 0 or 1 create ties that
            the logits did not have). Must be finite.
        targets: ``(n, C)`` of 0/1 (bool, int or float), the multi-hot ground truth.
    Returns:
        float64 ``(C,)``; NaN for a class without any positive example (where sklearn warns and
        returns 0).
    Raises:
        ValueError: for arrays that are not 2-D and non-empty, of different shapes, scores that are
            not finite, or targets other than 0/1.
    """
    s = _check_scores(scores, "scores")
    t = _check_binary(targets, "targets", s.shape)
    n, num_classes = s.shape
    block = max(1, _BLOCK_ELEMENTS // n)  # classes per block, to bound the memory of the transposed copies
    return np.concatenate([_block_average_precision(s[:, j:j + block], t[:, j:j + block])
                           for j in range(0, num_classes, block)])


def _block_average_precision(scores: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """:func:`average_precision` of a few classes (a column block)."""
    n = scores.shape[0]
    by_class = np.array(scores.T, order="C")  # (b, n) copy, sorted in place: contiguous rows sort fast
    positives = [row[mask] for row, mask in zip(by_class, np.ascontiguousarray(targets.T))]
    by_class.sort(axis=1)
    ap = np.full(len(positives), np.nan)
    for c, q in enumerate(positives):
        if q.size:
            q = np.sort(q)
            n_ge = n - np.searchsorted(by_class[c], q, side="left")  # examples scoring >= each positive
            p_ge = q.size - np.searchsorted(q, q, side="left")  # positives scoring >= each positive
            ap[c] = np.mean(p_ge / n_ge)
    return ap


def mean_average_precision(scores: Any, targets: Any) -> float:
    """Macro mean of :func:`average_precision` over the classes that have at least one positive
    example (classes without positives are left out rather than counted as 0).

    Args:
        scores: float ``(n, C)``; targets: 0/1 ``(n, C)`` (see :func:`average_precision`).
    Returns:
        A Python float in [0, 1].
    Raises:
        ValueError: when no class has a positive example, or for invalid inputs.
    """
    ap = average_precision(scores, targets)
    return _nan_free_mean(ap)


def _nan_free_mean(ap: np.ndarray) -> float:
    valid = ap[~np.isnan(ap)]
    if valid.size == 0:
        raise ValueError("mean average precision is undefined: no class has a positive example")
    return float(valid.mean())


def _divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with 0 where ``den == 0`` (sklearn's ``zero_division=0``)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    out = np.zeros(np.broadcast(num, den).shape)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _prf(tp: np.ndarray, n_pred: np.ndarray, n_true: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall and F1 from true-positive, predicted and actual counts (zero_division=0)."""
    precision = _divide(tp, n_pred)
    recall = _divide(tp, n_true)
    f1 = _divide(2 * tp, n_true + n_pred)  # = 2PR / (P + R), and 0 when there is nothing to find or predict
    return precision, recall, f1


def f1_scores(predicted: Any, targets: Any) -> dict[str, float]:
    """Micro and macro precision, recall and F1 of multi-label predictions.

    Micro: the counts of true positives, predictions and positives are summed over all ``n * C``
    entries first. Macro: the unweighted mean of the per-class values over the classes with a
    positive in ``targets`` (a class the split has no example of is left out; all ``C`` when none
    has a positive). A ratio with a zero denominator is 0, so the values equal
    ``sklearn.metrics.f1_score`` / ``precision_score`` / ``recall_score`` with ``average="micro"``,
    or ``"macro"`` and ``labels=`` those classes, and ``zero_division=0``; F1 is ``2 TP / (2 TP +
    FP + FN)``.

    Args:
        predicted: bool (or 0/1) ``(n, C)``, the predicted label set of each example.
        targets: 0/1 ``(n, C)``, the ground truth.
    Returns:
        ``{"micro_f1", "macro_f1", "micro_precision", "micro_recall", "macro_precision",
        "macro_recall"}``, Python floats in [0, 1].
    Raises:
        ValueError: for arrays that are not 2-D and non-empty, of different shapes, or not 0/1.
    """
    pred = _check_binary(predicted, "predicted")
    true = _check_binary(targets, "targets", pred.shape)
    tp = np.count_nonzero(pred & true, axis=0)
    n_pred, n_true = np.count_nonzero(pred, axis=0), np.count_nonzero(true, axis=0)
    micro = _prf(tp.sum(), n_pred.sum(), n_true.sum())
    present = n_true > 0 if n_true.any() else np.ones_like(n_true, dtype=bool)
    macro = [v[present] for v in _prf(tp, n_pred, n_true)]
    return {
        "micro_f1": float(micro[2]), "macro_f1": float(macro[2].mean()),
        "micro_precision": float(micro[0]), "micro_recall": float(micro[1]),
        "macro_precision": float(macro[0].mean()), "macro_recall": float(macro[1].mean()),
    }


def choose_threshold(probs: Any, targets: Any, grid: Any = None) -> float:
    """The single global threshold, among ``grid``, that maximises micro F1 when a label is
    predicted for every entry with ``probs >= threshold``.

    Typically chosen on a validation split and then applied to the test split. The comparison is
    exact, whatever the dtype of ``probs`` (a float32 probability equal to float32(0.7), which is
    below 0.7, is not predicted at threshold 0.7), as in :func:`multilabel_metrics`.

    Args:
        probs: float ``(n, C)``, the per-label probabilities (any finite scores work).
        targets: 0/1 ``(n, C)``.
        grid: the candidate thresholds, a non-empty 1-D sequence of finite floats; default
            ``0.05, 0.10, ..., 0.95``.
    Returns:
        The best threshold as a Python float (an element of ``grid``). Ties in micro F1 go to the
        threshold closest to 0.5, then to the smaller one.
    Raises:
        ValueError: for an empty or non-finite grid, or invalid ``probs``/``targets``.
    """
    p = _check_scores(probs, "probs")
    t = _check_binary(targets, "targets", p.shape)
    g = np.asarray(DEFAULT_THRESHOLD_GRID if grid is None else grid, dtype=np.float64)
    if g.ndim != 1 or g.size == 0 or not np.isfinite(g).all():
        raise ValueError(f"grid must be a non-empty 1-D sequence of finite thresholds, got {grid!r}")
    g = np.unique(g)  # sorted, as the search below needs
    bounds = _as_dtype_bounds(g, p.dtype)
    n_pred = _count_at_least(p.ravel(), bounds)  # predictions made at each threshold
    tp = _count_at_least(p[t], bounds)
    _, _, f1 = _prf(tp, n_pred, np.full(g.size, np.count_nonzero(t)))
    best = np.flatnonzero(f1 == f1.max())
    return float(min(g[best], key=lambda x: (round(abs(x - 0.5), 12), x)))


def _as_dtype_bounds(thresholds: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The smallest value of ``dtype`` that is ``>=`` each float64 threshold, so that ``x >= bound``
    computed in ``dtype`` equals the exact comparison ``x >= threshold`` (NumPy would otherwise round
    the threshold to the nearest ``dtype`` value, e.g. float32(0.7) < 0.7)."""
    bounds = thresholds.astype(dtype)
    low = bounds.astype(np.float64) < thresholds
    bounds[low] = np.nextafter(bounds[low], np.inf)
    return bounds


def _count_at_least(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``out[i] = #{values >= bounds[i]}`` for 1-D ``values``, by sorting blocks of ``values`` (a
    sort and a few binary searches beat one pass over ``values`` per bound)."""
    counts = np.zeros(bounds.size, dtype=np.int64)
    for start in range(0, values.size, _BLOCK_ELEMENTS):
        chunk = np.sort(values[start:start + _BLOCK_ELEMENTS])
        counts += chunk.size - np.searchsorted(chunk, bounds, side="left")
    return counts


def multilabel_metrics(probs: Any, targets: Any, threshold: float) -> dict[str, Any]:
    """The multi-label evaluation summary: mAP (threshold-free) and the micro/macro F1 of
    predicting the labels with ``probs >= threshold``.

    Args:
        probs: float ``(n, C)`` per-label probabilities (the sigmoid of the logits).
        targets: 0/1 ``(n, C)``.
        threshold: the decision threshold, e.g. from :func:`choose_threshold` on a validation split;
            ``probs >= threshold`` is compared exactly, whatever the dtype of ``probs``.
    Returns:
        ``{"map", "per_class_ap", "micro_f1", "macro_f1", "micro_precision", "micro_recall",
        "threshold"}``: Python floats, and ``per_class_ap`` a list of ``C`` floats with ``None`` for
        a class without positive examples, so the dict is JSON-serialisable (no NaN, no NumPy
        scalars).
    Raises:
        ValueError: when no class has a positive example, or for invalid inputs.
    """
    p = _check_scores(probs, "probs")
    ap = average_precision(p, targets)
    f1 = f1_scores(p >= _as_dtype_bounds(np.array([threshold], dtype=np.float64), p.dtype)[0], targets)
    return {
        "map": _nan_free_mean(ap),
        "per_class_ap": [None if np.isnan(a) else float(a) for a in ap],
        "micro_f1": f1["micro_f1"], "macro_f1": f1["macro_f1"],
        "micro_precision": f1["micro_precision"], "micro_recall": f1["micro_recall"],
        "threshold": float(threshold),
    }
