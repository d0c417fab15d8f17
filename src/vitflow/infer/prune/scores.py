"""Importance scores for structured pruning: heads and MLP units by the gates' gradients, blocks by
ablation (see :mod:`vitflow.infer.prune`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.data import model_input
from vitflow.data.transforms import Preprocess


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


def _gate(gate: torch.Tensor, width: int):
    """A forward pre-hook multiplying the module input's last dim by ``gate`` repeated ``width``
    times per entry (one gate per head of ``width`` channels, or per hidden unit)."""
    def hook(module, args):
        return (args[0] * gate.repeat_interleave(width),)
    return hook
