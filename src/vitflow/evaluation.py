"""Evaluation: loss, top-1, top-5, the confusion matrix and per-class top-1 of a model over a
loader of ``uint8`` batches; used by training (evaluations during a run), ``vitflow eval`` and
the accuracy checks of quantisation and pruning."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from vitflow.data import SkipReport, model_input
from vitflow.data.transforms import Preprocess
from vitflow.runtime import Precision


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, precision: Precision, pp: Preprocess,
             skips: SkipReport | None = None, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
             num_classes: int | None = None) -> dict[str, Any]:
    """One pass over ``loader`` in eval mode.

    Args:
        skips: warns once per unreadable image (default: a new report); pass one report to all the
            evaluations of a run to warn once in all. Its counts are not the result's ``skipped``.
        reduce: sums a tensor over the ranks of a distributed evaluation (each rank passing a
            loader over its own shard), e.g. :meth:`vitflow.train.distributed.DistEnv.all_reduce_sum`.
        num_classes: the model's class count (default: the logits' width).
    Returns:
        ``{"loss": mean cross-entropy (no smoothing), "top1": fraction, "top5": fraction,
        "images": images scored, "skipped": unreadable images in this pass (summed over the ranks),
        "confusion": C x C counts (row: true class, column: predicted class), "per_class_top1": C
        fractions (``None`` for a class without images)}``.
    Raises:
        ValueError: no readable image (on every rank together).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(5, dtype=torch.float64)  # loss sum, top-1, top-5, images, skipped
    confusion = torch.zeros((num_classes or 0) ** 2, dtype=torch.int64, device=device)
    skips = SkipReport() if skips is None else skips
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
        totals[0] += float(torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
        c1, c5 = topk_correct(logits, y)
        totals[1:4] += torch.tensor([c1, c5, len(y)], dtype=torch.float64)
    model.train(was_training)
    if reduce is not None:
        totals = reduce(totals.to(device)).cpu()
        confusion = reduce(confusion)
    loss_sum, c1, c5, n, skipped = totals.tolist()
    if n == 0:
        raise ValueError("evaluation found no readable images")
    c = math.isqrt(confusion.numel())
    confusion = confusion.view(c, c).cpu()
    counts = confusion.sum(dim=1).tolist()
    per_class = [hits / count if count else None for hits, count in zip(confusion.diag().tolist(), counts)]
    return {"loss": loss_sum / n, "top1": c1 / n, "top5": c5 / n, "images": int(n), "skipped": int(skipped),
            "confusion": confusion.tolist(), "per_class_top1": per_class}


def scalar_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` of :func:`evaluate` without its per-class entries (``confusion``,
    ``per_class_top1``): what metric logs and checkpoints keep."""
    return {k: v for k, v in result.items() if k not in ("confusion", "per_class_top1")}


@torch.no_grad()
def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of rows whose label is among the top-``k`` logits, for each ``k`` (``k`` capped at
    the class count). ``logits (B, C)``, ``labels int64 (B,)``."""
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices
    hit = top == labels.unsqueeze(1)
    return [int(hit[:, :min(k, maxk)].any(dim=1).sum()) for k in ks]
