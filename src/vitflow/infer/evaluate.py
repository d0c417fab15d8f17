"""``vitflow eval``: a checkpoint evaluated on its test split (its validation split when the data has no
test split, or another, by overrides)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.config import Config, build_config
from vitflow.data import ImageSource, eval_loader, open_split
from vitflow.data import check_config as check_data_config
from vitflow.data.sources.dispatch import scored_split
from vitflow.data.sources.splits import changed_selections, selection_record
from vitflow.data.transforms import Preprocess
from vitflow.evaluation import evaluate, evaluate_multilabel, scalar_metrics
from vitflow.infer.predict import Predictor, is_exported
from vitflow.infer.tta import parse_tta, with_tta
from vitflow.models import config_class
from vitflow.models.kernels import onednn
from vitflow.runtime import Precision, resolve_device, resolve_precision, use_threads

log = logging.getLogger(__name__)


def _apply_kernel_overrides(model: torch.nn.Module, saved: dict, wanted) -> None:
    """Apply ``model.attention`` / ``model.cpu_bf16_matmul`` when they differ from the checkpoint's:
    they choose kernels, not weights (e.g. fixed kernels for bit-identical repeats under bf16).
    Raises ValueError for a backend the model cannot use."""
    if wanted.attention != saved.get("attention", wanted.attention) and hasattr(model, "set_attention_backend"):
        model.set_attention_backend(wanted.attention)
    if wanted.cpu_bf16_matmul != saved.get("cpu_bf16_matmul", "auto") and hasattr(model, "set_cpu_bf16_matmul"):
        model.set_cpu_bf16_matmul(wanted.cpu_bf16_matmul)


@dataclass
class EvalSetup:
    """What an evaluation of a checkpoint needs before the model: the checkpoint, its config after
    the overrides, the device and precision, the checkpoint's preprocessing and the opened split it
    is scored on (``role`` ``test`` or ``val``, ``split`` its expression)."""

    state: dict
    cfg: Config
    device: torch.device
    precision: Precision
    preprocess: Preprocess
    role: str
    split: str
    source: ImageSource

    @property
    def task(self) -> str:
        return self.state.get("task", "multiclass")

    @property
    def batch_size(self) -> int:
        return self.cfg.data.eval_batch_size or 256

    def model(self, weights: str = "auto", img_size: int | None = None) -> torch.nn.Module:
        """The checkpoint's model on the device (:func:`~vitflow.checkpoint.model_from_checkpoint`,
        at ``img_size`` px when given) with the overrides' kernel choices. Raises ValueError."""
        model = model_from_checkpoint(self.state, weights, img_size).to(self.device)
        _apply_kernel_overrides(model, self.state["config"].get("model", {}), self.cfg.model)
        return model


def eval_setup(path, overrides=(), device: str | None = None) -> EvalSetup:
    """Read a checkpoint, build its config with ``key=value`` overrides and open the split it is
    scored on (:func:`~vitflow.data.sources.dispatch.scored_split`), labelled with its classes. On the
    run's own data, a split expression that now selects other images than when the run was trained
    is said in a warning (:func:`~vitflow.data.sources.splits.changed_selections`).

    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint; ConfigError; DataError.
    """
    state = load_checkpoint(path)
    cfg = build_config(base=state["config"], overrides=overrides, checks={"data": check_data_config},
                       model_config=config_class)
    use_threads(cfg.train.threads)
    dev = resolve_device(device or cfg.train.device)
    # an INT8 (dynamic quantized) checkpoint runs in fp32 on the CPU
    quantized = bool(state.get("quantization"))
    dev = torch.device("cpu") if quantized else dev
    precision = resolve_precision("fp32" if quantized else cfg.train.precision, dev)
    role, split = scored_split(cfg.data)
    source = open_split(cfg.data.path, split, cfg.data.source, classes=list(state["classes"]), cfg=cfg.data)
    trained_on = state["config"]["data"].get("path")
    if trained_on is not None and os.path.realpath(str(cfg.data.path)) == os.path.realpath(str(trained_on)):
        # the run's own data: does each split select what it did?
        for line in changed_selections(state.get("splits") or {}, {role: selection_record(source, split)},
                                       cfg.data.path):
            log.warning("%s: %s", path, line)
    return EvalSetup(state, cfg, dev, precision, Preprocess.from_dict(state["preprocess"]), role, split, source)


def score(setup: EvalSetup, model: torch.nn.Module, pp: Preprocess) -> dict:
    """One pass of ``model`` over the setup's split at ``pp`` (its ``image_size``): :func:`evaluate`'s
    metrics (:func:`evaluate_multilabel`'s at the saved threshold for a multi-label checkpoint),
    in the run's fp32 GEMM (rounding as its own evaluation did)."""
    state = setup.state
    loader = eval_loader(setup.source, pp, setup.batch_size, setup.cfg.data.num_workers)
    with onednn.run_gemm(state.get("fp32_gemm")):
        if setup.task == "multilabel":
            if state.get("threshold") is None:
                log.warning("%s has no saved threshold: choosing one on the %s split itself (optimistic F1)",
                            state["path"], setup.role)
            return evaluate_multilabel(model, loader, setup.device, setup.precision, pp,
                                       threshold=state.get("threshold"))
        return evaluate(model, loader, setup.device, setup.precision, pp)


def evaluate_checkpoint(path, overrides=(), device: str | None = None, weights: str = "auto", tta: str | None = None
                        ) -> dict:
    """Evaluate a checkpoint on its config's test split — or, when the data has none, its
    validation split (after ``key=value`` overrides, e.g. ``data.path=...`` or
    ``data.test_split=...``), labelling with the checkpoint's classes. A multi-label checkpoint
    is scored at the threshold saved with it (chosen on the validation split in training).
    ``model.img_size=S`` among the overrides evaluates at ``S`` pixels: the model built for ``S``
    with its position tables resampled as fine-tuning at ``S`` resamples them, the preprocessing at
    ``S`` (a row of ``vitflow bench resolution``).

    Args:
        weights: ``auto`` (the EMA weights when saved, else the trained ones), ``ema`` or ``raw``.
        tta: test-time augmentation (:mod:`vitflow.infer.tta`, e.g. ``flip``): the metrics are those of
            the averaged probabilities (the loss their negative log-likelihood).
    Returns:
        :func:`evaluate`'s (or :func:`evaluate_multilabel`'s) metrics prefixed with the split's
        role (``test_`` or ``val_``: scalars, and the per-class ``precision``, ``recall``, ``f1``,
        ``support``, ``confusion``, ``per_class_ap`` and the ``reliability`` diagram) plus ``classes``,
        ``split`` (the role), ``split_expr``, ``checkpoint``, ``step``, ``weights`` (``ema`` or ``raw``,
        the weights evaluated), ``tta`` (the spec, ``none`` without), ``image_size`` (pixels) and
        ``images_per_s`` (the whole pass, decoding included).
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, a ``model.img_size`` the model cannot
        take; ConfigError; DataError.
    """
    if is_exported(path):
        return evaluate_exported(path, overrides, tta)
    spec = parse_tta(tta)  # a bad spec fails before any work
    setup = eval_setup(path, overrides, device)
    state, role = setup.state, setup.role
    size = setup.cfg.model.img_size if setup.cfg.model.img_size != setup.preprocess.image_size else None
    model = with_tta(setup.model(weights, size), spec, setup.task)
    pp = replace(setup.preprocess, image_size=size) if size else setup.preprocess
    t0 = time.perf_counter()
    result = score(setup, model, pp)
    used = "ema" if state.get("ema") and weights != "raw" else "raw"
    return _result(result, role, setup.split, list(state["classes"]), state["path"], state["step"], used, spec, t0,
                   pp.image_size)


def _result(result: dict, role: str, split: str, classes: list[str], model: str, step: int | None, weights: str,
            spec, t0: float, image_size: int) -> dict:
    """The return value of :func:`evaluate_checkpoint` / :func:`evaluate_exported`."""
    ips = result["images"] / max(time.perf_counter() - t0, 1e-9)
    scalars = scalar_metrics(result)
    per_class = {k: v for k, v in result.items() if k not in scalars and k != "per_class_top1"}  # = the recall
    return {**{f"{role}_{k}": v for k, v in {**scalars, **per_class}.items()}, "split": role,
            "split_expr": split, "classes": classes, "checkpoint": model, "step": step, "weights": weights,
            "tta": str(spec), "image_size": image_size, "images_per_s": round(ips, 1)}


def evaluate_exported(path, overrides=(), tta: str | None = None, precision: str = "fp32") -> dict:
    """Evaluate an exported model (ONNX, OpenVINO IR: whatever
    :meth:`vitflow.infer.predict.Predictor.load` reads) on ``data.path``'s test split (its
    validation split when it has none), given as ``key=value`` overrides (``data.path=...``,
    ``data.test_split=...``): an export carries its classes and preprocessing, not its data.

    Returns:
        The keys of :func:`evaluate_checkpoint`; ``weights`` is ``exported``, ``step`` ``None``.
    Raises:
        ValueError: no ``data.path`` given; FileNotFoundError / ValueError: unreadable model; DataError.
    """
    cfg = build_config(base={}, overrides=overrides, checks={"data": check_data_config}, model_config=config_class)
    if cfg.data.path is None and cfg.data.source == "auto":
        raise ValueError(f"{path} carries no data path: evaluate it with data.path=PATH (and data.test_split=...)")
    predictor = Predictor.load(path, "cpu", precision)
    predictor.set_tta(tta)
    role, split = scored_split(cfg.data)
    source = open_split(cfg.data.path, split, cfg.data.source, classes=predictor.classes, cfg=cfg.data)
    loader = eval_loader(source, predictor.pp, cfg.data.eval_batch_size or 256, cfg.data.num_workers)
    t0, cpu = time.perf_counter(), torch.device("cpu")
    if predictor.task == "multilabel":
        result = evaluate_multilabel(predictor.model, loader, cpu, resolve_precision("fp32", cpu), predictor.pp,
                                     threshold=predictor.threshold)
    else:
        result = evaluate(predictor.model, loader, cpu, resolve_precision("fp32", cpu), predictor.pp)
    return _result(result, role, split, predictor.classes, str(path), None, "exported", predictor.tta, t0,
                   predictor.pp.image_size)
