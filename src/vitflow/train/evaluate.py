"""Evaluation: loss, top-1 and top-5 of a model over a loader of ``uint8`` batches."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from vitflow.data import SkipReport, normalize
from vitflow.data.transforms import Preprocess
from vitflow.train.amp import Precision
from vitflow.train.losses import topk_correct


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
        x = normalize(batch["images"].to(device, non_blocking=True), pp.mean, pp.std)
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


def _apply_kernel_overrides(model: torch.nn.Module, saved: dict, wanted) -> None:
    """Apply ``model.attention`` / ``model.cpu_bf16_matmul`` when they differ from the checkpoint's:
    they choose kernels, not weights (e.g. fixed kernels for bit-identical repeats under bf16).
    Raises ValueError for a backend the model cannot use."""
    if wanted.attention != saved.get("attention", wanted.attention) and hasattr(model, "set_attention_backend"):
        model.set_attention_backend(wanted.attention)
    if wanted.cpu_bf16_matmul != saved.get("cpu_bf16_matmul", "auto") and hasattr(model, "set_cpu_bf16_matmul"):
        model.set_cpu_bf16_matmul(wanted.cpu_bf16_matmul)


def evaluate_checkpoint(path, overrides=(), device: str | None = None, weights: str = "auto") -> dict:
    """Evaluate a checkpoint on its config's ``data.test_split`` (after ``key=value`` overrides,
    e.g. ``data.path=...`` or ``data.test_split=...``), labelling with the checkpoint's classes.

    Args:
        weights: ``auto`` (the EMA weights when saved, else the trained ones), ``ema`` or ``raw``.
    Returns:
        :func:`evaluate`'s scalar metrics prefixed ``test_`` plus ``checkpoint``, ``step`` and
        ``weights`` (``ema`` or ``raw``, the weights evaluated).
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint; ConfigError; DataError.
    """
    from vitflow.config import build_config
    from vitflow.data import eval_loader, open_split
    from vitflow.data.transforms import Preprocess
    from vitflow.train.amp import resolve_device, resolve_precision
    from vitflow.train.checkpoint import load_checkpoint, model_from_checkpoint

    state = load_checkpoint(path)
    cfg = build_config(base=state["config"], overrides=overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    dev = resolve_device(device or cfg.train.device)
    # an INT8 (dynamic quantized) checkpoint runs in fp32 on the CPU
    quantized = bool(state.get("quantization"))
    dev = torch.device("cpu") if quantized else dev
    precision = resolve_precision("fp32" if quantized else cfg.train.precision, dev)
    pp = Preprocess.from_dict(state["preprocess"])
    test = open_split(cfg.data.path, cfg.data.test_split, cfg.data.source, classes=list(state["classes"]))
    loader = eval_loader(test, pp, cfg.data.eval_batch_size or 256, cfg.data.num_workers)
    model = model_from_checkpoint(state, weights).to(dev)
    _apply_kernel_overrides(model, state["config"].get("model", {}), cfg.model)
    result = evaluate(model, loader, dev, precision, pp)
    used = "ema" if state.get("ema") and weights != "raw" else "raw"
    return {**{f"test_{k}": v for k, v in scalar_metrics(result).items()},
            "checkpoint": state["path"], "step": state["step"], "weights": used}
