"""The pruning itself: blocks, heads and MLP units physically removed from a vitflow ViT (see
:mod:`vitflow.infer.prune`)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from vitflow.infer.prune.scores import Importance
from vitflow.models.kernels.matmul import Linear


def remove_blocks(model: nn.Module, rise: torch.Tensor, count: int) -> tuple[nn.Module, list[int]]:
    """A copy of ``model`` without the ``count`` blocks whose removal raises the loss least
    (``rise`` from :func:`block_importance`), and the removed blocks' indices (ascending).

    Raises:
        ValueError: ``count`` not in ``[0, depth)`` (one block at least stays).
    """
    check_block_count(len(model.blocks), count)
    removed = sorted(torch.argsort(rise, stable=True)[:count].tolist())
    m = copy.deepcopy(model)
    m.set_token_merge(0)  # a per-block merge schedule would no longer fit
    for i in reversed(removed):
        del m.blocks[i]  # nn.Sequential renumbers: state-dict names stay blocks.0 ... blocks.{depth - count - 1}
    return m, removed


def check_block_count(depth: int, count: int) -> None:
    """Raises ValueError unless ``0 <= count < depth`` (one block at least stays)."""
    if not 0 <= count < depth:
        raise ValueError(f"blocks to remove must be in [0, {depth}) for a {depth}-block model, got {count}")


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
