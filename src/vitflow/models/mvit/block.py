"""The MViTv2 block with timm's names: ``norm1``, ``attn`` (pooling attention,
:mod:`.pooling`), ``shortcut_proj_attn`` / ``shortcut_pool_attn``, ``norm2``, ``mlp``,
``shortcut_proj_mlp``.

Li et al. 2022 (MViTv2) on Fan et al. 2021 (MViT): a pre-norm block whose attention pools its
queries (stride ``stride_q``: the first block of a stage halves the grid) and whose width may
change (``dim -> dim_out``); the skip connection then takes the same path: a linear projection
of the normalised input where the width changes (before the attention with ``expand_attn``, as
timm's ``shortcut_proj_attn``, else before the MLP, ``shortcut_proj_mlp``) and a max pool of
kernel ``stride + 1`` where the grid shrinks. The residual adds run inside the output GEMMs
(:class:`~vitflow.models.kernels.matmul.Linear`) while stochastic depth is inactive.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import LN_EPS, DropPath, LayerNorm, Mlp, active
from vitflow.models.mvit.pooling import MultiScaleAttention


def max_pool_tokens(x: torch.Tensor, grid: tuple[int, int], stride: Sequence[int], prefix: int) -> torch.Tensor:
    """The skip connection's pooling: max pool of kernel ``stride + 1`` (``stride`` where it is 1),
    padding ``kernel // 2``, over the grid tokens of ``x`` ``(B, prefix + H*W, C)``; class tokens
    kept. Runs in the token layout (channels last). ``(B, prefix + h*w, C)``."""
    b, _, c = x.shape
    kernel = tuple(s + 1 if s > 1 else s for s in stride)
    sp = x[:, prefix:].reshape(b, grid[0], grid[1], c).permute(0, 3, 1, 2)
    y = F.max_pool2d(sp.contiguous(memory_format=torch.channels_last), kernel, tuple(stride),
                     tuple(k // 2 for k in kernel))
    y = y.permute(0, 2, 3, 1).reshape(b, -1, c)
    return torch.cat((x[:, :prefix], y), dim=1) if prefix else y


class MultiScaleBlock(nn.Module):
    """One MViTv2 block: ``(B, prefix + H*W, dim)`` on ``grid`` -> ``(B, prefix + h*w, dim_out)``
    and the pooled grid.

    Args:
        dim, dim_out, num_heads, feat_size, mlp_ratio, qkv_bias, kernel_q, kernel_kv, stride_q,
            stride_kv, has_cls_token, residual, backend: as :class:`MultiScaleAttention` (its
            width ``dim_out`` with ``expand_attn``, else ``dim``).
        expand_attn: the width changes in the attention (timm's default), else in the MLP.
        drop_path: stochastic depth of both residual branches.
    """

    grad_checkpointing = False  # recompute this block's activations in the backward pass

    def __init__(self, dim: int, dim_out: int, num_heads: int, feat_size: tuple[int, int], mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_path: float = 0.0, kernel_q: Sequence[int] = (3, 3),
                 kernel_kv: Sequence[int] = (3, 3), stride_q: Sequence[int] = (1, 1),
                 stride_kv: Sequence[int] = (1, 1), has_cls_token: bool = False, expand_attn: bool = True,
                 residual: str = "all", backend: str = "sdpa"):
        super().__init__()
        proj_needed = dim != dim_out
        self.dim, self.dim_out, self.prefix = dim, dim_out, int(has_cls_token)
        self.stride_q = tuple(stride_q)
        self.norm1 = LayerNorm(dim, eps=LN_EPS)
        self.shortcut_proj_attn = Linear(dim, dim_out) if proj_needed and expand_attn else None
        self.pooled = any(s > 1 for s in self.stride_q)
        att_dim = dim_out if expand_attn else dim
        self.attn = MultiScaleAttention(dim, att_dim, num_heads, feat_size, qkv_bias, kernel_q, kernel_kv, stride_q,
                                        stride_kv, has_cls_token, residual, True, backend)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = LayerNorm(att_dim, eps=LN_EPS)
        self.shortcut_proj_mlp = Linear(dim, dim_out) if proj_needed and not expand_attn else None
        self.mlp = Mlp(att_dim, int(att_dim * mlp_ratio), out_dim=dim_out)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def shortcut(self, x: torch.Tensor, x_norm: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """The attention branch's skip: ``x`` (or its projection), max-pooled where the grid shrinks."""
        s = x if self.shortcut_proj_attn is None else self.shortcut_proj_attn(x_norm)
        return max_pool_tokens(s, grid, self.stride_q, self.prefix) if self.pooled else s

    def residual_in_gemm(self) -> bool:
        """Both residual adds can run inside the branches' last GEMMs: stochastic depth inactive and
        ``attn.proj`` / ``mlp.fc2`` vitflow's own :class:`~vitflow.models.kernels.matmul.Linear`
        without forward hooks (quantization and LoRA swap in others)."""
        return (not (active(self.drop_path1) or active(self.drop_path2)) and type(self.mlp) is Mlp
                and all(type(m) is Linear and not m._forward_hooks for m in (self.attn.proj, self.mlp.fc2)))

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
        fused = self.residual_in_gemm()
        x_norm = self.norm1(x)
        skip = self.shortcut(x, x_norm, grid)
        if fused:
            x, grid = self.attn(x_norm, grid, residual=skip)  # the add inside proj's GEMM
        else:
            out, grid = self.attn(x_norm, grid)
            x = skip + self.drop_path1(out)
        x_norm = self.norm2(x)
        skip = x if self.shortcut_proj_mlp is None else self.shortcut_proj_mlp(x_norm)
        if fused:
            return self.mlp(x_norm, residual=skip), grid
        return skip + self.drop_path2(self.mlp(x_norm)), grid

    def probs(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """This block's attention probabilities on its input (see :meth:`MultiScaleAttention.probs`)."""
        return self.attn.probs(self.norm1(x), grid)
