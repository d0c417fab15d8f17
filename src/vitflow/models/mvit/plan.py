"""An MViTv2's stage layout (widths, heads, query and key/value strides per stage) and
``grad_checkpointing=auto`` for it.

Checkpointing: a block's saved activations depend on its stage (the grid shrinks 4x and the
width doubles) and on whether it pools its queries (a stage's first block runs its qkv
projection at the previous stage's resolution). For each input shape, on the first training
forward, every block runs once without gradients to find its input and once under
``saved_tensors_hooks`` (explicit attention, so the plan is conservative:
:func:`~vitflow.models.grad_checkpointing.saved_activation_bytes`); blocks are then checkpointed,
largest saving first, until the kept bytes fit the budget
(:func:`vitflow.models.grad_checkpointing.choose_blocks`). The choice is logged and kept per input key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from vitflow.models.attention import auto
from vitflow.models.grad_checkpointing import choose_blocks, saved_activation_bytes
from vitflow.timing import tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageLayout:
    """Per stage: output width, heads, query stride (of its first block), key / value stride."""

    dims: tuple[int, ...]
    heads: tuple[int, ...]
    stride_q: tuple[int, ...]
    stride_kv: tuple[int, ...]


def stage_layout(depths: Sequence[int], embed_dim: int | Sequence[int], num_heads: int | Sequence[int],
                 stride_q: Sequence[int] | None, stride_kv_adaptive: int, expand_attn: bool = True) -> StageLayout:
    """timm's ``MultiScaleVitCfg`` rules: a single ``embed_dim`` / ``num_heads`` doubles per stage;
    query strides default to 1 then 2; the key / value stride starts at ``stride_kv_adaptive`` and
    is divided (to at least 1) by each stage's query stride.

    Raises:
        ValueError: per-stage lists of another length than ``depths``, or non-positive values.
    """
    n = len(depths)
    dims = tuple(embed_dim) if isinstance(embed_dim, (tuple, list)) else tuple(embed_dim * 2**i for i in range(n))
    heads = tuple(num_heads) if isinstance(num_heads, (tuple, list)) else tuple(num_heads * 2**i for i in range(n))
    sq = tuple(stride_q) if stride_q is not None else (1,) + (2,) * (n - 1)
    if not n or not all(len(t) == n for t in (dims, heads, sq)):
        raise ValueError(f"depths {tuple(depths)}, embed_dim {dims}, num_heads {heads} and stride_q {sq} must name "
                         "the same number of stages (or give embed_dim / num_heads as one number)")
    if min((*depths, *dims, *heads, *sq, stride_kv_adaptive)) < 1:
        raise ValueError("depths, widths, heads and strides must be >= 1")
    kv, skv = stride_kv_adaptive, []
    for s in sq:
        kv = max(kv // s, 1) if s > 1 else kv
        skv.append(kv)
    return StageLayout(dims, heads, sq, tuple(skv))


def _block_costs(model: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> list[tuple[int, int]]:
    """Per block ``(saved bytes, bytes of its input)`` for tokens ``x`` on ``grid``."""
    costs = []
    devices = [x.device] if x.device.type == "cuda" else []
    params = list(model.parameters())
    with torch.random.fork_rng(devices=devices):
        for blk in model.blocks:
            with auto.forced("math"):
                saved = saved_activation_bytes(lambda: blk(x.detach().requires_grad_(), grid)[0], exclude=params)
            costs.append((saved, x.numel() * x.element_size()))
            with torch.no_grad():
                x, grid = blk(x, grid)
    return costs


def plan_mvit_checkpointing(model: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> None:
    """Resolve ``model.checkpoint_plan`` (mode ``auto``) for the embedded tokens ``x``
    ``(B, N, C)`` on ``grid`` and mark the chosen blocks (once per input key; nothing while tracing)."""
    if tracing():
        return
    plan = model.checkpoint_plan
    key = (tuple(x.shape), x.dtype, str(x.device), torch.is_autocast_enabled(x.device.type))
    if key not in plan._auto:
        costs = _block_costs(model, x, grid)
        plan._auto[key] = choose_blocks(costs, plan.budget)
        log.info("grad checkpointing auto: %d of %d MViT blocks (%s MiB saved per block, budget %.1f MiB)",
                 len(plan._auto[key]), len(costs), [round(s / 2**20, 1) for s, _ in costs], plan.budget / 2**20)
    model.set_checkpointed(plan._auto[key])
