"""Structured pruning of a trained ViT: whole attention heads and MLP hidden units are removed,
so the ``qkv``/``proj`` and ``fc1``/``fc2`` matrices physically shrink and the model gets faster
on any hardware (no sparse kernels needed), followed by an optional short fine-tune with
knowledge distillation from the unpruned model.

Importance scores (first-order Taylor estimate of the loss change when a unit is removed):

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

import contextlib
import copy
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.data import normalize
from vitflow.data.transforms import Preprocess

log = logging.getLogger(__name__)


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
        for batch in batches:
            if n >= max_images or not len(batch["labels"]):
                if n >= max_images:
                    break
                continue
            x = normalize(batch["images"].to(device), pp.mean, pp.std)
            loss = F.cross_entropy(m(x), batch["labels"].to(device), reduction="sum")
            grads = torch.autograd.grad(loss, head_gates + mlp_gates)
            for acc, g in zip(head_acc + mlp_acc, grads):
                acc += g.abs()  # |dL/dxi| summed over the batch's images (the loss is a sum)
            n += len(batch["labels"])
    finally:
        for h in hooks:
            h.remove()
    if n == 0:
        raise ValueError("pruning needs calibration images; the calibration data yielded none")
    return Importance([a.cpu() / n for a in head_acc], [a.cpu() / n for a in mlp_acc], n)


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


def _slice_linear(lin: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> nn.Linear:
    w = lin.weight
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    out = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None).to(w.device, w.dtype)
    out.weight.copy_(w)
    if lin.bias is not None:
        out.bias.copy_(lin.bias[rows] if rows is not None else lin.bias)
    return out


def prune_model(model: nn.Module, importance: Importance, heads: float = 0.25, mlp: float = 0.0
                ) -> tuple[nn.Module, dict]:
    """A pruned copy of ``model`` and its per-block sizes.

    Args:
        heads, mlp: fractions of all attention heads / MLP hidden units to remove.
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


def distill_finetune(student: nn.Module, teacher: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                     steps: int, lr: float = 5e-4, weight_decay: float = 0.05, alpha: float = 0.5,
                     temperature: float = 2.0, label_smoothing: float = 0.1, precision=None,
                     device: torch.device | str = "cpu", log_every: int = 50) -> list[float]:
    """Fine-tune ``student`` in place for ``steps`` batches with knowledge distillation (Hinton,
    Vinyals & Dean 2015): ``loss = alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) *
    CE(student, labels)``. AdamW over vitflow's parameter groups, linear warmup over 5% of the
    steps then cosine decay to 0 (:mod:`vitflow.train.schedules`), gradient clipping at 1.0.

    Args:
        batches: an endless iterator of ``(x, targets)`` on ``device``: normalised ``float32
            (B, 3, S, S)`` and class indices ``int64 (B,)`` or soft targets ``(B, C)`` (Mixup),
            e.g. a vitflow train loader finished by its ``pipeline``.
        precision: a :class:`vitflow.train.amp.Precision` (autocast); ``None`` for fp32.
    Returns:
        The loss of every step.
    """
    from vitflow.config import OptimConfig
    from vitflow.train.optim import build_optimizer
    from vitflow.train.schedules import build_scheduler

    student.to(device).train()
    teacher = teacher.to(device).eval()
    cfg = OptimConfig(lr=lr, weight_decay=weight_decay, warmup_steps=max(1, steps // 20))
    opt = build_optimizer(student, cfg)
    sched = build_scheduler(opt, cfg, steps)
    autocast = precision.autocast if precision is not None else contextlib.nullcontext
    losses, it, t0 = [], iter(batches), time.perf_counter()
    for step in range(steps):
        x, y = next(it)
        with torch.no_grad(), autocast():
            t_logits = teacher(x).float()
        with autocast():
            s_logits = student(x).float()
        kd = F.kl_div(F.log_softmax(s_logits / temperature, -1), F.log_softmax(t_logits / temperature, -1),
                      reduction="batchmean", log_target=True) * temperature**2
        loss = alpha * kd + (1 - alpha) * F.cross_entropy(s_logits, y, label_smoothing=label_smoothing)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            log.info("fine-tune step %d/%d: loss %.4f (%.0f s)", step + 1, steps,
                     sum(losses[-log_every:]) / log_every, time.perf_counter() - t0)
    student.eval()
    return losses


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def prune_checkpoint(checkpoint, out, heads: float = 0.25, mlp: float = 0.0, data: str | None = None,
                     calib_images: int = 1024, finetune_steps: int = 0, batch_size: int = 128, lr: float = 5e-4,
                     alpha: float = 0.5, temperature: float = 2.0, evaluate: bool = True, eval_split: str | None = None,
                     log=print) -> dict:
    """Prune a checkpoint, optionally fine-tune with distillation, measure, and save.

    Data come from the checkpoint's config (``data.path``, train / test splits) or ``data``:
    calibration from ``<train split>[:calib_images]``, fine-tuning from the train split with
    the training augmentation, evaluation on the test split (or ``eval_split``).

    Returns:
        ``{"path", "params_before", "params_after", "block_heads", "block_mlp_hidden",
        "heads_before", "heads_after", "top1_before", "top1_pruned", "top1_after",
        "speedup_throughput", "speedup_latency", "finetune_steps", "finetune_s"}``
        (accuracy keys only with ``evaluate``).
    Raises:
        FileNotFoundError / ValueError / DataError: unreadable checkpoint or data, bad fractions,
        an already quantised checkpoint.
    """
    from vitflow.config import build_config
    from vitflow.data import eval_loader, train_loader
    from vitflow.data.splits import parse_split
    from vitflow.infer.bench import time_paths
    from vitflow.infer.calibration import accuracy, checkpoint_split
    from vitflow.infer.quantize import inference_state
    from vitflow.train.amp import resolve_precision
    from vitflow.train.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint

    if not (0 <= heads < 1 and 0 <= mlp < 1) or heads == mlp == 0:
        raise ValueError(f"give --heads and/or --mlp as fractions in [0, 1) to remove (got {heads}, {mlp})")
    state = load_checkpoint(checkpoint)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is quantized; prune the float checkpoint")
    cfg = build_config(base=state["config"])
    model = model_from_checkpoint(state).float()
    pp = Preprocess.from_dict(state["preprocess"])
    train_name = parse_split(cfg.data.train_split).name
    result: dict = {"path": str(out), "params_before": count_params(model)}

    calib = checkpoint_split(state, data, f"{train_name}[:{calib_images}]")
    t0 = time.perf_counter()
    scores = importance_scores(model, eval_loader(calib, pp, 64, cfg.data.num_workers), pp, calib_images)
    pruned, sizes = prune_model(model, scores, heads, mlp)
    log(f"importance from {scores.images} calibration images ({time.perf_counter() - t0:.0f} s); "
        f"heads per block {sizes['block_heads']}, MLP hidden {sizes['block_mlp_hidden']}")
    result.update(sizes, params_after=count_params(pruned), heads_before=sum(len(s) for s in scores.heads),
                  heads_after=sum(sizes["block_heads"]))

    test = checkpoint_split(state, data, eval_split) if evaluate else None
    if test is not None:
        result["top1_before"] = accuracy(model, test, pp)["top1"]
        result["top1_pruned"] = accuracy(pruned, test, pp)["top1"]
        log(f"top-1 on {len(test)} images: {result['top1_before']:.2%} before, {result['top1_pruned']:.2%} pruned")
    if finetune_steps:
        cpu = torch.device("cpu")
        train = checkpoint_split(state, data, cfg.data.train_split)
        loader = train_loader(train, cfg.data, pp.image_size, batch_size, cfg.train.seed, cpu, len(state["classes"]))
        pairs = (loader.pipeline(b) for b in loader if len(b["labels"]))
        t0 = time.perf_counter()
        try:
            distill_finetune(pruned, model, pairs, finetune_steps, lr, alpha=alpha, temperature=temperature,
                             label_smoothing=cfg.train.label_smoothing,
                             precision=resolve_precision(cfg.train.precision, cpu))
        finally:
            loader.close()
        result.update(finetune_steps=finetune_steps, finetune_s=round(time.perf_counter() - t0, 1))
        if test is not None:
            result["top1_after"] = accuracy(pruned, test, pp)["top1"]
            log(f"top-1 after {finetune_steps} distillation steps: {result['top1_after']:.2%}")
    timing = time_paths({"unpruned": model.eval(), "pruned": pruned.eval()}, pp.image_size, log=lambda s: None)
    before, after = timing["unpruned"].summary(), timing["pruned"].summary()
    result.update(speedup_throughput=round(after["throughput_ips"] / before["throughput_ips"], 3),
                  speedup_latency=round(before["latency_ms_p50"] / after["latency_ms_p50"], 3),
                  timing={"unpruned": before, "pruned": after})
    save_checkpoint({**inference_state(state), "model": pruned.state_dict(),
                     "model_args": {**state["model_args"], **sizes},
                     "metrics": {"top1": result.get("top1_after", result.get("top1_pruned"))},
                     "pruning": {k: v for k, v in result.items() if k != "path"}}, out)
    return result
