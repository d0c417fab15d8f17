"""``vitflow eval``: a checkpoint evaluated on its test split (or another, by overrides)."""

from __future__ import annotations

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.config import build_config
from vitflow.data import check_config as check_data_config
from vitflow.data import eval_loader, open_split
from vitflow.data.transforms import Preprocess
from vitflow.evaluation import evaluate, scalar_metrics
from vitflow.runtime import resolve_device, resolve_precision


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
    state = load_checkpoint(path)
    cfg = build_config(base=state["config"], overrides=overrides, checks={"data": check_data_config})
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
