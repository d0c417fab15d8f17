"""Structured pruning of a trained ViT: whole blocks, attention heads and MLP hidden units are
removed, so the model has fewer layers and its ``qkv``/``proj`` and ``fc1``/``fc2`` matrices
physically shrink: it gets faster on any hardware (no sparse kernels needed), followed by an
optional short fine-tune with knowledge distillation from the unpruned model.

Blocks go first, by ablation: a block's importance is the rise of the calibration images' mean
cross-entropy when it is skipped (tokens passed on unchanged), as Michel et al. 2019 (sec. 3) ablate
heads; Gromov et al. 2024 and Men et al. 2024 ("ShortGPT") drop transformer blocks by similar
scores. The blocks with the smallest rise go at once (one pass, not greedy). Fewer blocks shorten
batch-1 latency, where a small model's time goes to the number of operations more than their size.

Heads and MLP units are then scored on the shallower model (first-order Taylor estimate of the
loss change when a unit is removed):

- head ``h`` of block ``l``: ``I = E_x |dL/d xi_h|`` where ``xi_h`` is a gate multiplying the
  head's output (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?", eq. 2);
- MLP hidden unit ``j``: ``I = E_x |dL/d g_j|`` for a gate on its activation (Molchanov et al.
  2017, "Pruning Convolutional Neural Networks for Resource Efficient Inference").

Scores are L2-normalised per block (Michel et al., sec. 4.2) and ranked globally, so blocks that
matter less lose more units; every block keeps at least one head and one hidden unit.

The pruned model is a regular :class:`vitflow.models.VisionTransformer` built with per-block
``block_heads`` / ``block_mlp_hidden`` (saved in the checkpoint's ``model_args``), so it loads,
evaluates, predicts, exports and quantises like any other.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from vitflow.config import DataConfig, TrainConfig, build_config
from vitflow.data import ImageSource, eval_loader, model_input, train_loader
from vitflow.data.sources.splits import parse_split
from vitflow.data.transforms import Preprocess
from vitflow.infer.bench.timing import speedups
from vitflow.infer.calibration import accuracy, checkpoint_split
from vitflow.infer.quantize.dynamic import inference_state
from vitflow.models import config_class
from vitflow.models.kernels.matmul import Linear
from vitflow.runtime import resolve_precision

log = logging.getLogger(__name__)
Finetune = Callable[..., object]


@dataclass
class Importance:
    """Per-block importance scores: ``heads[l]`` ``(H_l,)``, ``mlp[l]`` ``(hidden_l,)`` (float32,
    averaged over the calibration images), and how many images they came from."""

    heads: list[torch.Tensor]
    mlp: list[torch.Tensor]
    images: int


def importance_scores(model: nn.Module, batches: Iterable[dict], pp: Preprocess, max_images: int = 1024,
                      device: torch.device | str = "cpu") -> Importance:
    """Head and MLP-unit importance of ``model`` on labelled calibration batches.

    Args:
        model: a vitflow ViT (not modified; a copy is gated).
        batches: ``{"images": uint8 (B, 3, S, S), "labels": int64 (B,)}`` dicts (a vitflow loader).
        pp: the model's preprocessing (normalisation).
        max_images: stop after this many images.
    Returns:
        :class:`Importance` (raw, un-normalised scores).
    Raises:
        ValueError: no calibration image.
    """
    m = copy.deepcopy(model).float().to(device).train(False)
    for p in m.parameters():
        p.requires_grad_(False)
    head_gates, mlp_gates, hooks = [], [], []
    for blk in m.blocks:
        hg = torch.ones(blk.attn.num_heads, device=device, requires_grad=True)
        mg = torch.ones(blk.mlp.fc1.out_features, device=device, requires_grad=True)
        head_gates.append(hg)
        mlp_gates.append(mg)
        hooks.append(blk.attn.proj.register_forward_pre_hook(_gate(hg, blk.attn.head_dim)))
        hooks.append(blk.mlp.fc2.register_forward_pre_hook(_gate(mg, 1)))
    head_acc = [torch.zeros_like(g) for g in head_gates]
    mlp_acc = [torch.zeros_like(g) for g in mlp_gates]
    n = 0
    try:
        for x, y in _calibration(batches, pp, max_images, device):
            loss = F.cross_entropy(m(x), y, reduction="sum")
            grads = torch.autograd.grad(loss, head_gates + mlp_gates)
            for acc, g in zip(head_acc + mlp_acc, grads):
                acc += g.abs()  # |dL/dxi| summed over the batch's images (the loss is a sum)
            n += len(y)
    finally:
        for h in hooks:
            h.remove()
    return Importance([a.cpu() / n for a in head_acc], [a.cpu() / n for a in mlp_acc], n)


@torch.no_grad()
def block_importance(model: nn.Module, batches: Iterable[dict], pp: Preprocess, max_images: int = 1024,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Each block's importance by ablation: how much the mean cross-entropy (nats per image) on
    labelled calibration batches rises when the block is skipped (its output replaced by its
    input).

    Args:
        model: a vitflow ViT (not modified; a copy is evaluated).
        batches: labelled batches, as :func:`importance_scores` takes them.
        pp: the model's preprocessing (normalisation).
        max_images: stop after this many images.
    Returns:
        ``(rise (depth,) float32, images used)``; a negative rise: the block hurts these images.
    Raises:
        ValueError: no calibration image.
    """
    m = copy.deepcopy(model).float().to(device).train(False)
    depth = len(m.blocks)
    total = torch.zeros(depth + 1, dtype=torch.float64)  # [skip block 0, ..., skip block L-1, intact]
    n = 0
    for x, y in _calibration(batches, pp, max_images, device):
        total[depth] += float(F.cross_entropy(m(x), y, reduction="sum"))
        for i, blk in enumerate(m.blocks):
            hook = blk.register_forward_hook(lambda mod, args, out: args[0])
            try:
                total[i] += float(F.cross_entropy(m(x), y, reduction="sum"))
            finally:
                hook.remove()
        n += len(y)
    return ((total[:depth] - total[depth]) / n).float(), n


def _calibration(batches: Iterable[dict], pp: Preprocess, max_images: int, device):
    """``(x, labels)`` model inputs from labelled batches until ``max_images`` images were yielded
    (empty batches skipped). Raises ValueError when there are none."""
    n = 0
    for batch in batches:
        if n >= max_images:
            break
        if len(batch["labels"]):
            yield model_input(batch["images"], pp.mean, pp.std, device), batch["labels"].to(device)
            n += len(batch["labels"])
    if n == 0:
        raise ValueError("pruning needs calibration images; the calibration data yielded none")


def remove_blocks(model: nn.Module, rise: torch.Tensor, count: int) -> tuple[nn.Module, list[int]]:
    """A copy of ``model`` without the ``count`` blocks whose removal raises the loss least
    (``rise`` from :func:`block_importance`), and the removed blocks' indices (ascending).

    Raises:
        ValueError: ``count`` not in ``[0, depth)`` (one block at least stays).
    """
    _check_block_count(len(model.blocks), count)
    removed = sorted(torch.argsort(rise, stable=True)[:count].tolist())
    m = copy.deepcopy(model)
    m.set_token_merge(0)  # a per-block merge schedule would no longer fit
    for i in reversed(removed):
        del m.blocks[i]  # nn.Sequential renumbers: state-dict names stay blocks.0 ... blocks.{depth - count - 1}
    return m, removed


def _check_block_count(depth: int, count: int) -> None:
    if not 0 <= count < depth:
        raise ValueError(f"blocks to remove must be in [0, {depth}) for a {depth}-block model, got {count}")


def _gate(gate: torch.Tensor, width: int):
    """A forward pre-hook multiplying the module input's last dim by ``gate`` repeated ``width``
    times per entry (one gate per head of ``width`` channels, or per hidden unit)."""
    def hook(module, args):
        return (args[0] * gate.repeat_interleave(width),)
    return hook


def select_units(scores: list[torch.Tensor], fraction: float) -> list[list[int]]:
    """Indices to keep per block after removing ``round(fraction * total)`` units with the lowest
    per-block L2-normalised scores; each block keeps at least one unit.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"pruning fraction must be in [0, 1), got {fraction}")
    normed = [s / (s.norm() + 1e-12) for s in scores]
    total = sum(len(s) for s in scores)
    n_remove = round(fraction * total)
    order = sorted(((float(v), li, ui) for li, s in enumerate(normed) for ui, v in enumerate(s)))
    removed: list[set[int]] = [set() for _ in scores]
    for _, li, ui in order:
        if n_remove == 0:
            break
        if len(scores[li]) - len(removed[li]) > 1:
            removed[li].add(ui)
            n_remove -= 1
    return [[u for u in range(len(s)) if u not in removed[li]] for li, s in enumerate(scores)]


@torch.no_grad()
def prune_heads_(attn: nn.Module, keep: list[int]) -> None:
    """Keep only heads ``keep`` of a vitflow ``Attention`` in place: rows of ``qkv`` (for each of
    q, k, v), columns of ``proj`` and of the relative position bias table (if any) are sliced,
    ``num_heads`` updated; ``head_dim`` unchanged."""
    h, d = attn.num_heads, attn.head_dim
    idx = torch.tensor([s * h * d + k * d + j for s in range(3) for k in keep for j in range(d)])
    cols = torch.tensor([k * d + j for k in keep for j in range(d)])
    attn.qkv = _slice_linear(attn.qkv, rows=idx)
    attn.proj = _slice_linear(attn.proj, cols=cols)
    if getattr(attn, "rel_pos", None) is not None:  # per-head relative position bias: keep its columns
        table = attn.rel_pos.relative_position_bias_table
        table.data = table.data[:, keep].clone()
    attn.num_heads = len(keep)


@torch.no_grad()
def prune_mlp_(mlp: nn.Module, keep: list[int]) -> None:
    """Keep only hidden units ``keep`` of a vitflow ``Mlp`` in place (rows of ``fc1``, columns of
    ``fc2``)."""
    idx = torch.tensor(keep)
    mlp.fc1 = _slice_linear(mlp.fc1, rows=idx)
    mlp.fc2 = _slice_linear(mlp.fc2, cols=idx)


def _slice_linear(lin: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> Linear:
    w = lin.weight
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    out = Linear(w.shape[1], w.shape[0], bias=lin.bias is not None, gemm=getattr(lin, "gemm", "auto")).to(w.device,
                                                                                                         w.dtype)
    out.weight.copy_(w)
    if lin.bias is not None:
        out.bias.copy_(lin.bias[rows] if rows is not None else lin.bias)
    return out


def prune_model(model: nn.Module, importance: Importance, heads: float = 0.25, mlp: float = 0.0
                ) -> tuple[nn.Module, dict]:
    """A pruned copy of ``model`` and its per-block sizes.

    Args:
        heads: fraction of all attention heads to remove.
        mlp: fraction of all MLP hidden units to remove.
    Returns:
        ``(pruned model, {"block_heads": [...], "block_mlp_hidden": [...]})``; the dict extends
        the checkpoint's ``model_args`` so :func:`vitflow.create_model` rebuilds the shape.
    """
    m = copy.deepcopy(model)
    keep_heads = select_units(importance.heads, heads)
    keep_mlp = select_units(importance.mlp, mlp)
    for blk, kh, km in zip(m.blocks, keep_heads, keep_mlp):
        if len(kh) < blk.attn.num_heads:
            prune_heads_(blk.attn, kh)
        if len(km) < blk.mlp.fc1.out_features:
            prune_mlp_(blk.mlp, km)
    sizes = {"block_heads": [len(k) for k in keep_heads], "block_mlp_hidden": [len(k) for k in keep_mlp]}
    return m, sizes


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def prune_checkpoint(checkpoint, out, heads: float = 0.25, mlp: float = 0.0, blocks: int = 0, data: str | None = None,
                     calib_images: int = 1024, finetune_steps: int = 0, batch_size: int = 128, lr: float = 5e-4,
                     alpha: float = 0.5, temperature: float = 2.0, evaluate: bool = True, eval_split: str | None = None,
                     log=print, finetune: Finetune | None = None) -> dict:
    """Prune a checkpoint (``blocks`` whole blocks, then the fractions ``heads`` and ``mlp`` of what is
    left), optionally fine-tune with distillation, measure, and save.

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
        named ``.pt``, bad fractions or block count, an already quantised or a multi-label checkpoint, fine-tune
        steps without ``finetune``.
    """
    _check_request(out, heads, mlp, blocks, finetune_steps, finetune)
    state = _float_checkpoint(checkpoint)
    if state.get("task", "multiclass") == "multilabel":
        raise ValueError(f"{state['path']} is a multi-label model: pruning scores and distils single-label "
                         "classifiers only")
    cfg = build_config(base=state["config"], model_config=config_class)
    model = model_from_checkpoint(state).float()
    pp = Preprocess.from_dict(state["preprocess"])
    result: dict = {"path": str(out), "params_before": count_params(model)}
    pruned, sizes, removed = _calibrate_and_prune(model, state, cfg.data, pp, data, calib_images, (blocks, heads, mlp),
                                                  log)
    result.update(sizes, blocks_removed=removed, params_after=count_params(pruned),
                  heads_before=sum(b.attn.num_heads for b in model.blocks), heads_after=sum(sizes["block_heads"]))

    test = checkpoint_split(state, data, eval_split) if evaluate else None
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


def _check_request(out, heads: float, mlp: float, blocks: int, finetune_steps: int, finetune: Finetune | None) -> None:
    """Raises ValueError for an output not named ``.pt``, fractions outside ``[0, 1)``, a negative
    block count, nothing to remove, fine-tune steps without a fine-tune function."""
    if finetune_steps and finetune is None:
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
    _check_block_count(len(model.blocks), blocks)  # before the scores are computed
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
    return pruned, sizes, removed
