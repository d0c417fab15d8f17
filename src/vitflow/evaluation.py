"""Evaluation of a model over a loader of ``uint8`` batches: for single-label classification loss,
top-1, top-5, the confusion matrix and per-class top-1 (:func:`evaluate`); for multi-label
classification loss, mAP, per-class AP and F1 at a threshold (:func:`evaluate_multilabel`); each
pass also computes the metrics of :data:`vitflow.metrics.METRICS` declared with a ``compute`` of
their own. Used by training (evaluations during a run), ``vitflow eval`` and the accuracy checks of
quantisation and pruning."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from vitflow.data import SkipReport, model_input
from vitflow.data.transforms import Preprocess
from vitflow.metrics import (
    Accumulator,
    headline,  # noqa: F401  headline: vitflow.evaluation.headline, as before
    interval_figures,
    meaningful,
)
from vitflow.metrics.classification import ECE_BINS, calibration, calibration_counts, confusion_metrics
from vitflow.metrics.multilabel import choose_threshold, multilabel_metrics
from vitflow.runtime import Precision


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, precision: Precision, pp: Preprocess,
             skips: SkipReport | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
             num_classes: int | None = None, hits: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """One pass over ``loader`` in eval mode.

    Args:
        skips: warns once per unreadable image (default: a new report); pass one report to all the
            evaluations of a run to warn once in all. Its counts are not the result's ``skipped``.
        reduce: sums a tensor over the ranks of a distributed evaluation (each rank passing a
            loader over its own shard), e.g. :meth:`vitflow.training.scale.distributed.DistEnv.all_reduce_sum`.
        num_classes: the model's class count (default: the logits' width).
        hits: gets, per batch, whether each image's top-1 was right (``bool (B,)``, CPU, in order).
    Returns:
        ``{"loss": mean cross-entropy (no smoothing), "top1": fraction, "top5": fraction (only for 6
        classes or more: :func:`vitflow.metrics.meaningful`),
        "images": images scored, "skipped": unreadable images in this pass (summed over the ranks),
        "confusion": C x C counts (row: true class, column: predicted class), "per_class_top1": C
        fractions (``None`` for a class without images)}``, and the keys of
        :func:`vitflow.metrics.classification.confusion_metrics` (precision / recall / F1 / support per class,
        macro and weighted averages, balanced accuracy) and :func:`vitflow.metrics.classification.calibration`
        (``ece``, ``reliability``), computed from integer sums: exact in a distributed evaluation;
        then the declared metrics with a ``compute`` (:class:`vitflow.metrics.Accumulator`), and
        the 95% intervals of those with one (``top1_ci95``, ``top5_ci95``, ``macro_f1_ci95``,
        ``balanced_accuracy_ci95``: ``[low, high]`` fractions, :mod:`vitflow.metrics.intervals`).
    Raises:
        ValueError: no readable image (on every rank together).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(5, dtype=torch.float64)  # loss sum, top-1, top-5, images, skipped
    confusion = torch.zeros((num_classes or 0) ** 2, dtype=torch.int64, device=device)
    bins = torch.zeros(3, ECE_BINS, dtype=torch.int64, device=device)  # calibration: count, correct, confidence sums
    skips, extra = SkipReport() if skips is None else skips, Accumulator("multiclass")
    for batch in loader:
        totals[4] += len(batch["bad"])
        skips.add(-1, batch["bad"])  # -1: not a training epoch
        if len(batch["labels"]) == 0:
            continue
        x = model_input(batch["images"], pp.mean, pp.std, device)
        y = batch["labels"].to(device, non_blocking=True)
        with precision.autocast():
            logits = model(x)
        c = logits.shape[1]
        if confusion.numel() != c * c:
            confusion = torch.zeros(c * c, dtype=torch.int64, device=device)
        confusion += torch.bincount(y * c + logits.argmax(dim=1), minlength=c * c)
        bins += calibration_counts(logits, y, bins.shape[1])
        extra.add(logits, y)
        totals[0] += float(torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
        c1, c5 = topk_correct(logits, y)
        if hits is not None:
            hits.append((logits.argmax(dim=1) == y).cpu())
        totals[1:4] += torch.tensor([c1, c5, len(y)], dtype=torch.float64)
    model.train(was_training)
    if reduce is not None:
        totals = reduce(totals.to(device)).cpu()
        confusion = reduce(confusion)
        bins = reduce(bins)
        extra.reduce(reduce)
    return _figures(totals, confusion, bins, extra)


def _figures(totals: torch.Tensor, confusion: torch.Tensor, bins: torch.Tensor, extra: Accumulator) -> dict[str, Any]:
    """:func:`evaluate`'s result from its sums (over the ranks): ``totals`` float64 (loss sum,
    top-1 and top-5 hits, images, skipped), ``confusion`` int64 ``(C * C,)``, ``bins`` int64 ``(3, M)``."""
    loss_sum, c1, c5, n, skipped = totals.tolist()
    if n == 0:
        raise ValueError("evaluation found no readable images")
    c = math.isqrt(confusion.numel())
    confusion = confusion.view(c, c).cpu()
    counts = confusion.sum(dim=1).tolist()
    per_class = [hits / count if count else None for hits, count in zip(confusion.diag().tolist(), counts)]
    result = {"loss": loss_sum / n, "top1": c1 / n, "top5": c5 / n, "images": int(n), "skipped": int(skipped),
              "confusion": confusion.tolist(), "per_class_top1": per_class, **confusion_metrics(confusion),
              **calibration(bins)}
    inputs = {**result, "confusion": confusion.numpy(), "calibration": bins.cpu().numpy()}
    result = meaningful({**result, **extra.results(inputs)}, c)  # no top-5 of fewer than 6 classes
    return {**result, **interval_figures({**result, "confusion": inputs["confusion"]}, "multiclass")}


@torch.no_grad()
def evaluate_multilabel(model: torch.nn.Module, loader, device: torch.device, precision: Precision, pp: Preprocess,
                        skips: SkipReport | None = None, threshold: float | None = None) -> dict[str, Any]:
    """One pass over ``loader`` (multi-hot ``uint8 (B, C)`` labels) in eval mode, scoring every
    label with its sigmoid probability.

    Args:
        threshold: the probability from which a label is predicted; ``None`` chooses the one that
            maximises micro F1 on this pass (:func:`vitflow.metrics.multilabel.choose_threshold`) — do that
            on the validation split only, and pass its threshold to the test split.
    Returns:
        ``{"loss": mean binary cross-entropy per label, "map": macro mean average precision over
        the classes with a positive, "micro_f1", "macro_f1", "micro_precision", "micro_recall"
        (at ``threshold``), "threshold", "images", "skipped", "per_class_ap": C values (``None``
        for a class without a positive)}``, then the declared metrics with a ``compute``.
    Raises:
        ValueError: no readable image, or no positive label at all.
    """
    was_training = model.training
    model.eval()
    probs, targets, skipped = [], [], 0
    skips, extra = SkipReport() if skips is None else skips, Accumulator("multilabel")
    for batch in loader:
        skipped += len(batch["bad"])
        skips.add(-1, batch["bad"])
        if len(batch["labels"]) == 0:
            continue
        with precision.autocast():
            logits = model(model_input(batch["images"], pp.mean, pp.std, device))
        probs.append(torch.sigmoid(logits.float()).cpu())
        extra.add(logits, batch["labels"])
        targets.append(batch["labels"].float())
    model.train(was_training)
    if not probs:
        raise ValueError("evaluation found no readable images")
    p, t = torch.cat(probs).double(), torch.cat(targets).double()
    loss = float(torch.nn.functional.binary_cross_entropy(p, t))
    p, t = p.numpy(), t.numpy()
    if threshold is None:
        threshold = choose_threshold(p, t)
    result = {"loss": loss, **multilabel_metrics(p, t, threshold), "images": len(t), "skipped": skipped}
    return {**result, **extra.results({**result, "probs": p, "targets": t})}


def scalar_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` of :func:`evaluate` / :func:`evaluate_multilabel` without its per-class entries
    (the lists and mappings: ``confusion``, ``per_class_top1``, ``per_class_ap``, per-class
    ``precision`` / ``recall`` / ``f1`` / ``support``, ``reliability``): what metric logs and
    checkpoints keep."""
    return {k: v for k, v in result.items() if not isinstance(v, (list, tuple, dict))}


def split_results(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A run summary's figures by split: ``{"val": {"top1": ...}, "test": {...}}`` (``R_*`` keys)."""
    return {role: {k[len(role) + 1:]: v for k, v in summary.items() if k.startswith(role + "_")}
            for role in ("val", "test") if f"{role}_loss" in summary}


@torch.no_grad()
def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of rows whose label is among the top-``k`` logits, for each ``k`` (``k`` capped at
    the class count). ``logits (B, C)``, ``labels int64 (B,)``."""
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices
    hit = top == labels.unsqueeze(1)
    return [int(hit[:, :min(k, maxk)].any(dim=1).sum()) for k in ks]
