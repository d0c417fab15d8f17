"""Evaluation: loss, top-1 and top-5 of a model over a loader of ``uint8`` batches."""

from __future__ import annotations

import torch

from vitflow.data import SkipReport, normalize
from vitflow.data.transforms import Preprocess
from vitflow.train.amp import Precision
from vitflow.train.losses import topk_correct


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, precision: Precision, pp: Preprocess,
             skips: SkipReport | None = None) -> dict[str, float]:
    """One pass over ``loader`` in eval mode.

    Returns:
        ``{"loss": mean cross-entropy (no smoothing), "top1": fraction, "top5": fraction,
        "images": images scored, "skipped": unreadable images}``.
    Raises:
        ValueError: the loader yielded no readable image.
    """
    was_training = model.training
    model.eval()
    n = correct1 = correct5 = 0
    loss_sum = 0.0
    skipped = 0
    for batch in loader:
        skipped += len(batch["bad"])
        if skips is not None:
            skips.add(-1, batch["bad"])
        if len(batch["labels"]) == 0:
            continue
        x = normalize(batch["images"].to(device, non_blocking=True), pp.mean, pp.std)
        y = batch["labels"].to(device, non_blocking=True)
        with precision.autocast():
            logits = model(x)
        loss_sum += float(torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
        c1, c5 = topk_correct(logits, y)
        correct1, correct5, n = correct1 + c1, correct5 + c5, n + len(y)
    model.train(was_training)
    if n == 0:
        raise ValueError("evaluation found no readable images")
    return {"loss": loss_sum / n, "top1": correct1 / n, "top5": correct5 / n, "images": n, "skipped": skipped}


def evaluate_checkpoint(path, overrides=(), device: str | None = None) -> dict:
    """Evaluate a checkpoint on its config's ``data.test_split`` (after ``key=value`` overrides,
    e.g. ``data.path=...`` or ``data.test_split=...``), labelling with the checkpoint's classes.

    Returns:
        :func:`evaluate`'s metrics prefixed ``test_`` plus ``checkpoint`` and ``step``.
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
    result = evaluate(model_from_checkpoint(state).to(dev), loader, dev, precision, pp)
    return {**{f"test_{k}": v for k, v in result.items()}, "checkpoint": state["path"], "step": state["step"]}
