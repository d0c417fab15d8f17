"""``vitflow eval``: a checkpoint evaluated on its test split (its validation split when the data has no
test split, or another, by overrides)."""

from __future__ import annotations

import logging
import time

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.config import build_config
from vitflow.data import check_config as check_data_config
from vitflow.data import eval_loader, open_split
from vitflow.data.sources.dispatch import scored_split
from vitflow.data.transforms import Preprocess
from vitflow.evaluation import evaluate, evaluate_multilabel, scalar_metrics
from vitflow.infer.tta import parse_tta, with_tta
from vitflow.models import config_class
from vitflow.models.kernels import onednn
from vitflow.runtime import resolve_device, resolve_precision

log = logging.getLogger(__name__)


def _apply_kernel_overrides(model: torch.nn.Module, saved: dict, wanted) -> None:
    """Apply ``model.attention`` / ``model.cpu_bf16_matmul`` when they differ from the checkpoint's:
    they choose kernels, not weights (e.g. fixed kernels for bit-identical repeats under bf16).
    Raises ValueError for a backend the model cannot use."""
    if wanted.attention != saved.get("attention", wanted.attention) and hasattr(model, "set_attention_backend"):
        model.set_attention_backend(wanted.attention)
    if wanted.cpu_bf16_matmul != saved.get("cpu_bf16_matmul", "auto") and hasattr(model, "set_cpu_bf16_matmul"):
        model.set_cpu_bf16_matmul(wanted.cpu_bf16_matmul)


def evaluate_checkpoint(path, overrides=(), device: str | None = None, weights: str = "auto", tta: str | None = None
                        ) -> dict:
    """Evaluate a checkpoint on its config's test split — or, when the data has none, its
    validation split (after ``key=value`` overrides, e.g. ``data.path=...`` or
    ``data.test_split=...``), labelling with the checkpoint's classes. A multi-label checkpoint
    is scored at the threshold saved with it (chosen on the validation split in training).

    Args:
        weights: ``auto`` (the EMA weights when saved, else the trained ones), ``ema`` or ``raw``.
        tta: test-time augmentation (:mod:`vitflow.infer.tta`, e.g. ``flip``): the metrics are those of
            the averaged probabilities (the loss their negative log-likelihood).
    Returns:
        :func:`evaluate`'s (or :func:`evaluate_multilabel`'s) metrics prefixed with the split's
        role (``test_`` or ``val_``: scalars, and the per-class ``precision``, ``recall``, ``f1``,
        ``support``, ``confusion``, ``per_class_ap`` and the ``reliability`` diagram) plus ``classes``,
        ``split`` (the role), ``split_expr``, ``checkpoint``, ``step``, ``weights`` (``ema`` or ``raw``,
        the weights evaluated), ``tta`` (the spec, ``none`` without) and ``images_per_s`` (the whole
        pass, decoding included).
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint; ConfigError; DataError.
    """
    spec = parse_tta(tta)  # a bad spec fails before any work
    state = load_checkpoint(path)
    cfg = build_config(base=state["config"], overrides=overrides, checks={"data": check_data_config},
                       model_config=config_class)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    dev = resolve_device(device or cfg.train.device)
    # an INT8 (dynamic quantized) checkpoint runs in fp32 on the CPU
    quantized = bool(state.get("quantization"))
    dev = torch.device("cpu") if quantized else dev
    precision = resolve_precision("fp32" if quantized else cfg.train.precision, dev)
    pp = Preprocess.from_dict(state["preprocess"])
    role, split = scored_split(cfg.data)
    source = open_split(cfg.data.path, split, cfg.data.source, classes=list(state["classes"]), cfg=cfg.data)
    loader = eval_loader(source, pp, cfg.data.eval_batch_size or 256, cfg.data.num_workers)
    model = model_from_checkpoint(state, weights).to(dev)
    _apply_kernel_overrides(model, state["config"].get("model", {}), cfg.model)
    model, t0 = with_tta(model, spec, state.get("task", "multiclass")), time.perf_counter()
    with onednn.run_gemm(state.get("fp32_gemm")):  # the run's fp32 GEMM: rounds as its own evaluation did
        if state.get("task", "multiclass") == "multilabel":
            if state.get("threshold") is None:
                log.warning("%s has no saved threshold: choosing one on the %s split itself (optimistic F1)",
                            state["path"], role)
            result = evaluate_multilabel(model, loader, dev, precision, pp, threshold=state.get("threshold"))
        else:
            result = evaluate(model, loader, dev, precision, pp)
    ips = result["images"] / max(time.perf_counter() - t0, 1e-9)
    used = "ema" if state.get("ema") and weights != "raw" else "raw"
    scalars = scalar_metrics(result)
    per_class = {k: v for k, v in result.items() if k not in scalars and k != "per_class_top1"}  # = the recall
    return {**{f"{role}_{k}": v for k, v in {**scalars, **per_class}.items()}, "split": role,
            "split_expr": split, "classes": list(state["classes"]), "checkpoint": state["path"],
            "step": state["step"], "weights": used, "tta": str(spec), "images_per_s": round(ips, 1)}
