"""``vitflow prune``: a checkpoint pruned, optionally fine-tuned with distillation, measured and
saved (see :mod:`vitflow.infer.prune`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from vitflow.config import DataConfig, TrainConfig, build_config
from vitflow.data import ImageSource, eval_loader, train_loader
from vitflow.data.sources.splits import parse_split
from vitflow.data.transforms import Preprocess
from vitflow.infer.bench.timing import speedups
from vitflow.infer.calibration import accuracy, checkpoint_split
from vitflow.infer.prune.scores import block_importance, importance_scores
from vitflow.infer.prune.surgery import check_block_count, count_params, prune_model, remove_blocks
from vitflow.infer.quantize.dynamic import inference_state
from vitflow.models import config_class
from vitflow.runtime import resolve_precision

Finetune = Callable[..., object]


def prune_checkpoint(checkpoint, out, heads: float | None = None, mlp: float = 0.0, blocks: int = 0, data: str | None = None,
                     calib_images: int = 1024, finetune_steps: int = 0, batch_size: int = 128, lr: float = 5e-4,
                     alpha: float = 0.5, temperature: float = 2.0, evaluate: bool = True, eval_split: str | None = None,
                     log=print, finetune: Finetune | None = None) -> dict:
    """Prune a checkpoint (``blocks`` whole blocks, then fractions ``heads``, default 0.25 alone and 0 beside
    ``blocks`` or ``mlp``, and ``mlp`` of what is left), optionally fine-tune with distillation, measure, save.

    ``finetune`` runs the fine-tune (``finetune_steps > 0``), e.g.
    :func:`vitflow.training.objectives.distill.distill_finetune`: called as ``finetune(student, teacher, pairs,
    steps, lr, alpha=, temperature=, label_smoothing=, precision=)`` with ``pairs`` an endless
    iterator of ``(x, targets)`` model inputs (the inference layer does not train).

    Data come from the checkpoint's config (``data.path``, train / test splits) or ``data``:
    calibration from ``<train split>[:calib_images]``, fine-tuning from the train split with
    the training augmentation, evaluation on the test split (or ``eval_split``).

    Returns:
        ``{"path", "params_before", "params_after", "depth", "blocks_removed", "block_heads",
        "block_mlp_hidden", "heads_before", "heads_after", "top1_before", "top1_pruned", "top1_after",
        "speedup_throughput", "speedup_latency", "finetune_steps", "finetune_s"}``
        (accuracy keys only with ``evaluate``).
    Raises:
        FileNotFoundError / ValueError / DataError: unreadable checkpoint or data, an output not
        named ``.pt``, bad fractions, block count or fine-tune numbers, an already quantised or a
        multi-label checkpoint, fine-tune steps without ``finetune``.
    """
    heads = (0.0 if blocks or mlp else 0.25) if heads is None else heads
    _check_request(out, (blocks, heads, mlp), finetune, dict(finetune_steps=finetune_steps, calib_images=calib_images,
                   batch_size=batch_size, lr=lr, alpha=alpha, temperature=temperature))
    state = _float_checkpoint(checkpoint)
    if state.get("task", "multiclass") == "multilabel":
        raise ValueError(f"{state['path']} is a multi-label model: pruning scores and distils single-label "
                         "classifiers only")
    cfg = build_config(base=state["config"], model_config=config_class)
    model = model_from_checkpoint(state).float()
    pp = Preprocess.from_dict(state["preprocess"])
    result: dict = {"path": str(out), "params_before": count_params(model)}
    test = checkpoint_split(state, data, eval_split) if evaluate else None  # a bad split fails before the work
    pruned, sizes, removed = _calibrate_and_prune(model, state, cfg.data, pp, data, calib_images, (blocks, heads, mlp),
                                                  log)
    result.update(sizes, blocks_removed=removed, params_after=count_params(pruned),
                  heads_before=sum(b.attn.num_heads for b in model.blocks), heads_after=sum(sizes["block_heads"]))
    if test is not None:
        result["top1_before"] = accuracy(model, test, pp)["top1"]
        result["top1_pruned"] = accuracy(pruned, test, pp)["top1"]
        log(f"top-1 on {len(test)} images: {result['top1_before']:.2%} before, {result['top1_pruned']:.2%} pruned")
    if finetune_steps:
        t0 = time.perf_counter()
        _finetune(finetune, pruned, model, checkpoint_split(state, data, cfg.data.train_split), cfg.data, cfg.train, pp,
                  finetune_steps, batch_size, lr, alpha, temperature)
        result.update(finetune_steps=finetune_steps, finetune_s=round(time.perf_counter() - t0, 1))
        if test is not None:
            result["top1_after"] = accuracy(pruned, test, pp)["top1"]
            log(f"top-1 after {finetune_steps} distillation steps: {result['top1_after']:.2%}")
    result.update(speedups({"unpruned": model, "pruned": pruned}, pp.image_size))
    save_checkpoint({**inference_state(state), "model": pruned.state_dict(),
                     "model_args": {**state["model_args"], **sizes},
                     "metrics": {"top1": result.get("top1_after", result.get("top1_pruned"))},
                     "pruning": {k: v for k, v in result.items() if k != "path"}}, out)
    return result


def _check_request(out, amounts: tuple[int, float, float], finetune: Finetune | None, numbers: dict) -> None:
    """Raises ValueError for an output not named ``.pt``, fractions outside ``[0, 1)``, a negative
    block count, nothing to remove, a fine-tune number out of its range (``numbers``: steps,
    calibration images, batch size, lr, alpha, temperature), fine-tune steps without a fine-tune
    function: before any work is done."""
    blocks, heads, mlp = amounts
    n = numbers
    rules = {"finetune_steps": (n["finetune_steps"] >= 0, ">= 0"), "calib_images": (n["calib_images"] >= 1, ">= 1"),
             "batch_size": (n["batch_size"] >= 1, ">= 1"), "lr": (n["lr"] > 0, "> 0"),
             "alpha": (0 <= n["alpha"] <= 1, "in [0, 1]"), "temperature": (n["temperature"] > 0, "> 0")}
    bad = [f"{k} must be {rule}, got {n[k]}" for k, (ok, rule) in rules.items() if not ok]
    if bad:
        raise ValueError("; ".join(bad))
    if n["finetune_steps"] and finetune is None:
        raise ValueError("finetune_steps > 0 needs a finetune function (vitflow.training.objectives.distill.distill_finetune)")
    if Path(out).suffix.lower() != ".pt":
        raise ValueError(f"output {out}: a pruned model is written as a checkpoint; name it *.pt (then "
                         "vitflow export or quantize it)")
    if not (0 <= heads < 1 and 0 <= mlp < 1) or blocks < 0 or heads == mlp == blocks == 0:
        raise ValueError(f"give --heads and/or --mlp as fractions in [0, 1) to remove, and/or --blocks as a count "
                         f"(got heads {heads}, mlp {mlp}, blocks {blocks})")


def _finetune(finetune: Finetune, pruned: nn.Module, model: nn.Module, train: ImageSource, d: DataConfig,
              t: TrainConfig, pp: Preprocess, steps: int, batch_size: int, lr: float, alpha: float,
              temperature: float) -> None:
    """Run ``finetune`` on the CPU over ``train`` with the checkpoint's training augmentation (its data
    section ``d``; seed, label smoothing and precision from its train section ``t``)."""
    cpu = torch.device("cpu")
    loader = train_loader(train, d, pp.image_size, batch_size, t.seed, cpu, len(train.classes))
    pairs = (loader.device_batch(b) for b in loader if len(b["labels"]))
    try:
        finetune(pruned, model, pairs, steps, lr, alpha=alpha, temperature=temperature,
                 label_smoothing=t.label_smoothing, precision=resolve_precision(t.precision, cpu))
    finally:
        loader.close()


def _float_checkpoint(path) -> dict:
    """The checkpoint at ``path``; raises ValueError for a quantized one (prune the float one)."""
    state = load_checkpoint(path)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is quantized; prune the float checkpoint")
    return state


def _calibrate_and_prune(model: nn.Module, state: dict, d: DataConfig, pp: Preprocess, data: str | None, calib_images: int,
                         amounts: tuple[int, float, float], log) -> tuple[nn.Module, dict, list[int]]:
    """Block ablation scores, then head / MLP scores on the shallower model, on the first
    ``calib_images`` of the training split; the pruned copy, its ``model_args`` sizes and the
    removed blocks. ``amounts``: ``(blocks, heads, mlp)``. Raises ValueError for a model that
    declares ``supports_pruning = False``."""
    if not getattr(model, "supports_pruning", True):
        raise ValueError(f"{state['path']}: {state['model_args'].get('name', type(model).__name__)} cannot be pruned: "
                         "structured pruning handles the plain ViT layout (fused qkv, GELU MLP) only")
    blocks, heads, mlp = amounts
    check_block_count(len(model.blocks), blocks)  # before the scores are computed
    calib = checkpoint_split(state, data, f"{parse_split(d.train_split).name}[:{calib_images}]")
    t0 = time.perf_counter()
    removed: list[int] = []
    if blocks:
        rise, _ = block_importance(model, eval_loader(calib, pp, 64, d.num_workers), pp, calib_images)
        model, removed = remove_blocks(model, rise, blocks)
        log("loss rise when each block is skipped (nats): " + ", ".join(f"{v:.3f}" for v in rise.tolist())
            + f"; removed blocks {removed}")
    pruned = model
    if heads or mlp:
        scores = importance_scores(model, eval_loader(calib, pp, 64, d.num_workers), pp, calib_images)
        pruned, _ = prune_model(model, scores, heads, mlp)
    sizes = {"depth": len(pruned.blocks), "block_heads": [b.attn.num_heads for b in pruned.blocks],
             "block_mlp_hidden": [b.mlp.fc1.out_features for b in pruned.blocks]}
    log(f"importance from the first {calib_images} training images ({time.perf_counter() - t0:.0f} s); "
        f"{sizes['depth']} blocks, heads per block {sizes['block_heads']}, MLP hidden {sizes['block_mlp_hidden']}")
    for what, fraction, before, after in (
            ("heads", heads, [b.attn.num_heads for b in model.blocks], sizes["block_heads"]),
            ("mlp", mlp, [b.mlp.fc1.out_features for b in model.blocks], sizes["block_mlp_hidden"])):
        total, asked, went = sum(before), round(fraction * sum(before)), sum(before) - sum(after)
        if went < asked:  # select_units keeps one a block
            log(f"--{what} {fraction:g} asks for {asked} of {total} removed; {went} were, as every block keeps "
                "at least one")
    return pruned, sizes, removed
