"""Single-label classification metrics from counts: per-class precision, recall, F1 and support,
their macro and weighted averages, balanced accuracy (from the confusion matrix), and the expected
calibration error with its reliability diagram (from per-bin sums).

Both inputs are sums, so a distributed evaluation adds them over the ranks and gets exactly the
figures of one process: the confusion matrix is ``int64``; the calibration bins hold the image
count, the number correct (``int64``) and the sum of the confidences in fixed point (``int64``,
units of ``2**-32``: :data:`CONFIDENCE_SCALE`), so that integer addition, which does not depend on
the order, replaces float sums, which do.

The definitions follow scikit-learn (``precision_recall_fscore_support`` with
``labels=range(C)`` and ``zero_division=0``, ``balanced_accuracy_score``) so that the values can be
checked against it, and Guo et al. 2017 ("On Calibration of Modern Neural Networks", ICML) for the
ECE; the implementation is our own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ECE_BINS = 15  # Guo et al. 2017: M = 15 equal-width confidence bins
CONFIDENCE_SCALE = 2 ** 32  # fixed-point unit of the summed confidences (exact, order-free integer sums)


def calibration_counts(logits: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> torch.Tensor:
    """Per-bin sums of one batch for :func:`calibration`: ``int64 (3, bins)`` rows = image count,
    correct count, sum of confidences in units of ``1 / CONFIDENCE_SCALE``.

    The confidence of an image is its largest softmax probability (float32 softmax of the logits),
    its prediction the arg-max; bin ``m`` (0-based) holds confidences in ``(m / M, (m + 1) / M]``
    (bin 0 also takes exactly 0), as in Guo et al. 2017.

    Args:
        logits: ``(B, C)`` any float dtype; labels: ``int64 (B,)``, on the same device.
    Returns:
        ``int64 (3, bins)`` on the logits' device; add them over batches and ranks.
    """
    probs = logits.detach().float().softmax(dim=1)
    conf, pred = probs.max(dim=1)
    conf64 = conf.double()
    index = (torch.ceil(conf64 * bins) - 1).clamp_(0, bins - 1).long()
    out = torch.zeros(3, bins, dtype=torch.int64, device=logits.device)
    out[0].scatter_add_(0, index, torch.ones_like(index))
    out[1].scatter_add_(0, index, (pred == labels).long())
    out[2].scatter_add_(0, index, torch.round(conf64 * CONFIDENCE_SCALE).long())
    return out


def calibration(counts: Any) -> dict[str, Any]:
    """Expected calibration error and reliability diagram from :func:`calibration_counts` sums.

    ``ECE = sum_m (|B_m| / n) * |acc(B_m) - conf(B_m)|`` over the ``M`` bins (Guo et al. 2017, eq. 3),
    ``acc`` the fraction correct and ``conf`` the mean confidence of the images in the bin.

    Args:
        counts: ``(3, M)`` integer sums (count, correct, confidence in ``1 / CONFIDENCE_SCALE``).
    Returns:
        ``{"ece": float in [0, 1], "reliability": {"bins": the M + 1 bin edges 0, 1/M, ..., 1,
        "accuracy": M fractions, "confidence": M mean confidences, "count": M image counts}}``
        (``None`` for an empty bin's accuracy and confidence): JSON-serialisable.
    Raises:
        ValueError: counts of another shape, or no image at all.
    """
    c = np.asarray(counts.cpu() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64)
    if c.ndim != 2 or c.shape[0] != 3:
        raise ValueError(f"calibration counts must have shape (3, bins), got {c.shape}")
    n, correct, conf = c[0], c[1], c[2].astype(np.float64) / CONFIDENCE_SCALE
    total = int(n.sum())
    if total == 0:
        raise ValueError("calibration needs at least one image")
    m = c.shape[1]
    filled = n > 0
    acc = np.divide(correct, n, out=np.zeros(m), where=filled)
    mean_conf = np.divide(conf, n, out=np.zeros(m), where=filled)
    ece = float(np.sum(n / total * np.abs(acc - mean_conf)))
    return {"ece": ece, "reliability": {
        "bins": [k / m for k in range(m + 1)],
        "accuracy": [float(a) if f else None for a, f in zip(acc, filled)],
        "confidence": [float(v) if f else None for v, f in zip(mean_conf, filled)],
        "count": [int(k) for k in n]}}


def _divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` with 0 where ``den == 0`` (scikit-learn's ``zero_division=0``)."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.zeros(np.broadcast(num, den).shape), where=den != 0)


def confusion_metrics(confusion: Any) -> dict[str, Any]:
    """Per-class and averaged precision / recall / F1, support and balanced accuracy of a
    confusion matrix (row: true class, column: predicted class).

    Per class ``c``: precision ``TP / predicted``, recall ``TP / support``, F1 ``2 TP / (support +
    predicted)``, each 0 when its denominator is (scikit-learn's ``zero_division=0``): a class never
    predicted has precision 0, a class absent from the targets recall 0 and support 0. Macro: the
    unweighted mean over all ``C`` classes (absent ones included, as
    ``precision_recall_fscore_support(labels=range(C), average="macro")``); weighted: weighted by
    support. Balanced accuracy: the mean recall over the classes that occur in the targets
    (``balanced_accuracy_score``; Brodersen et al. 2010).

    Args:
        confusion: ``(C, C)`` non-negative integer counts (NumPy, list or torch tensor).
    Returns:
        ``{"precision", "recall", "f1", "support"}`` (lists of ``C`` floats / ints) and
        ``"macro_precision", "macro_recall", "macro_f1", "weighted_precision", "weighted_recall",
        "weighted_f1", "balanced_accuracy"`` (floats in [0, 1]).
    Raises:
        ValueError: not a square 2-D matrix, or no image at all.
    """
    m = np.asarray(confusion.cpu() if isinstance(confusion, torch.Tensor) else confusion, dtype=np.int64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.size == 0:
        raise ValueError(f"confusion must be a non-empty square (C, C) matrix, got shape {m.shape}")
    support, predicted, tp = m.sum(axis=1), m.sum(axis=0), np.diag(m)
    if support.sum() == 0:
        raise ValueError("confusion matrix holds no image")
    precision, recall = _divide(tp, predicted), _divide(tp, support)
    f1 = _divide(2 * tp, support + predicted)
    weights = support / support.sum()
    present = support > 0
    out: dict[str, Any] = {"precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist(),
                           "support": support.tolist()}
    for name, values in (("precision", precision), ("recall", recall), ("f1", f1)):
        out[f"macro_{name}"] = float(values.mean())
        out[f"weighted_{name}"] = float(np.sum(values * weights))
    out["balanced_accuracy"] = float(recall[present].mean())
    return out


def per_class_text(classes: list[str], result: dict[str, Any], limit: int = 50) -> str:
    """A plain-text table of :func:`confusion_metrics`' per-class figures (first ``limit`` classes)
    and the averages, for ``vitflow eval``."""
    width = max([len("weighted avg"), *(len(c) for c in classes[:limit])])
    lines = [f"{'class':<{width}}  precision  recall     F1  support"]
    for i, name in enumerate(classes[:limit]):
        lines.append(f"{name:<{width}}  {result['precision'][i]:9.2%} {result['recall'][i]:7.2%} "
                     f"{result['f1'][i]:6.2%}  {result['support'][i]:7d}")
    if len(classes) > limit:
        lines.append(f"... {len(classes) - limit} more classes (see --json)")
    total = sum(result["support"])
    for avg in ("macro", "weighted"):
        lines.append(f"{avg + ' avg':<{width}}  {result[f'{avg}_precision']:9.2%} {result[f'{avg}_recall']:7.2%} "
                     f"{result[f'{avg}_f1']:6.2%}  {total:7d}")
    lines.append(f"balanced accuracy {result['balanced_accuracy']:.2%}  ECE {result['ece']:.4f} "
                 f"({len(result['reliability']['count'])} bins)")
    return "\n".join(lines)
