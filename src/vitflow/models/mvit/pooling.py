"""MViTv2's pooling attention module with timm's names (``attn.qkv``, ``attn.pool_q`` / ``_k`` /
``_v``, ``attn.norm_q`` / ``_k`` / ``_v``, ``attn.rel_pos_h`` / ``_w``, ``attn.proj``).

Pooling attention (Li et al. 2022, sec. 4.1; Fan et al. 2021 for the pooling operator): the
qkv projection runs at the block's input resolution, then q, k and v are each pooled over the
token grid by a depthwise 3x3 convolution (one ``(d, 1, k, k)`` kernel shared by the heads,
stride ``stride_q`` for q and ``stride_kv`` for k, v; class tokens pass unpooled) and
layer-normalised per head; attention between the pooled tokens with the decomposed relative
position term and the residual pooling connection is one of the kernels of
:mod:`vitflow.models.attention.pooling`. The pooling convolutions run in the token layout
(channels last, no head-major copies before the convolution) by :func:`pool_tokens`.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.attention.pooling import (
    PoolingContext,
    gather_rel_pos,
    make_pooling_kernel,
    pooling_probs,
    rel_pos_terms,
)
from vitflow.models.kernels.matmul import Linear
from vitflow.models.kernels.pool import fits, pool_qkv
from vitflow.models.layers import LN_EPS, LayerNorm

log = logging.getLogger(__name__)
_LOGGED: set[tuple] = set()


def pooled_size(size: int, kernel: int, stride: int) -> int:
    """Output side of a convolution / max pool of ``kernel`` with ``stride`` and padding ``kernel // 2``."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


def pool_tokens(x: torch.Tensor, grid: tuple[int, int], heads: int, conv: nn.Conv2d | None,
                prefix: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """Pool one of q, k, v over the token grid.

    Args:
        x: ``(B, prefix + H*W, heads*d)`` (a column slice of the qkv projection: the last
            dimension's stride must be 1), tokens row-major.
        grid: ``(H, W)``.
        conv: a depthwise ``Conv2d(d, d, k, stride, k // 2, groups=d)`` applied to every head
            (timm's per-head convolution), or ``None`` for no pooling.
        prefix: class tokens before the grid (copied, not pooled).
    Returns:
        head-major ``(B, heads, prefix + h*w, d)`` contiguous in ``x``'s dtype (bf16 under
        autocast), and the pooled grid ``(h, w)``.
    """
    b, _, c = x.shape
    h, w = grid
    if conv is None:
        y, out_grid = x[:, prefix:].reshape(b, h * w, c), grid
    else:
        sp = x[:, prefix:].reshape(b, h, w, c).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        weight = conv.weight.repeat(heads, 1, 1, 1)
        y = F.conv2d(sp, weight, stride=conv.stride, padding=conv.padding, groups=c)
        out_grid = (y.shape[-2], y.shape[-1])
        y = y.permute(0, 2, 3, 1).reshape(b, out_grid[0] * out_grid[1], c)
    if prefix:
        y = torch.cat((x[:, :prefix].to(y.dtype), y), dim=1)
    return y.view(b, y.shape[1], heads, c // heads).transpose(1, 2).contiguous(), out_grid


class MultiScaleAttention(nn.Module):
    """Multi-head pooling attention ``(B, prefix + H*W, dim)`` -> ``(B, prefix + h*w, dim_out)``.

    Args:
        dim, dim_out: input and output widths (``qkv``: ``dim -> 3 dim_out``).
        num_heads: heads (``head_dim = dim_out // num_heads``).
        feat_size: the block's input grid at the model's image size: sizes the relative tables
            (``2 max(q, kv) - 1`` rows, timm's rule; other grids resample them at run time).
        qkv_bias, kernel_q, kernel_kv, stride_q, stride_kv: as timm's; a pooling of kernel 1 and
            stride 1 is left out (no conv, no norm).
        has_cls_token: one class token before the grid.
        residual: ``all`` / ``grid`` / ``none`` (:mod:`vitflow.models.attention.pooling`).
        rel_pos: decomposed relative position embeddings (``rel_pos_h``, ``rel_pos_w``).
        backend: ``sdpa``, ``math`` or ``auto``.

    Raises:
        ValueError: ``dim_out`` not divisible by ``num_heads``, or an unknown backend.
    """

    def __init__(self, dim: int, dim_out: int, num_heads: int, feat_size: tuple[int, int], qkv_bias: bool = True,
                 kernel_q: Sequence[int] = (3, 3), kernel_kv: Sequence[int] = (3, 3), stride_q: Sequence[int] = (1, 1),
                 stride_kv: Sequence[int] = (1, 1), has_cls_token: bool = False, residual: str = "all",
                 rel_pos: bool = True, backend: str = "sdpa"):
        super().__init__()
        if dim_out % num_heads:
            raise ValueError(f"stage width {dim_out} is not divisible by its {num_heads} heads")
        self.num_heads, self.dim_out, self.head_dim = num_heads, dim_out, dim_out // num_heads
        self.prefix, self.residual = int(has_cls_token), residual
        self.qkv = Linear(dim, dim_out * 3, bias=qkv_bias)
        self.proj = Linear(dim_out, dim_out)
        d = self.head_dim
        for name, kernel, stride in (("q", kernel_q, stride_q), ("k", kernel_kv, stride_kv), ("v", kernel_kv, stride_kv)):
            pooled = not (tuple(kernel) == (1, 1) and tuple(stride) == (1, 1))
            conv = nn.Conv2d(d, d, tuple(kernel), tuple(stride), tuple(k // 2 for k in kernel), groups=d, bias=False)
            setattr(self, f"pool_{name}", conv if pooled else None)
            setattr(self, f"norm_{name}", LayerNorm(d, eps=LN_EPS) if pooled else None)
        self.rel_pos_h = self.rel_pos_w = None
        if rel_pos:
            size = feat_size[0]
            rows = 2 * max(size // stride_q[1], size // stride_kv[1]) - 1
            self.rel_pos_h = nn.Parameter(torch.zeros(rows, d))
            self.rel_pos_w = nn.Parameter(torch.zeros(rows, d))
            for t in (self.rel_pos_h, self.rel_pos_w):
                nn.init.trunc_normal_(t, std=0.02)
        self.set_backend(backend)

    def set_backend(self, backend: str, **_options) -> None:
        """Use pooling-attention kernel ``backend``; other backend options are ignored.
        Raises ValueError for an unknown name."""
        self.kernel = make_pooling_kernel(backend)
        self.backend = backend

    def pool(self, qkv: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        """Pooled, normalised head-major q, k, v ``(B, H, prefix + n, d)`` and their grids: vitflow's
        C++ kernel where it fits (:func:`vitflow.models.kernels.pool.pool_qkv`), else
        :func:`pool_tokens` per third."""
        convs = (self.pool_q, self.pool_k, self.pool_v)
        if fits(qkv, convs):
            pooled = pool_qkv(qkv, convs, grid, self.prefix, self.num_heads)
            grids = [tuple(pooled_size(s, c.kernel_size[0], c.stride[0]) for s in grid) for c in convs]
        else:
            c = self.dim_out
            pooled, grids = zip(*(pool_tokens(qkv[..., i * c:(i + 1) * c], grid, self.num_heads, conv, self.prefix)
                                  for i, conv in enumerate(convs)))
        norms = (self.norm_q, self.norm_k, self.norm_v)
        q, k, v = (t if norm is None else norm(t) for t, norm in zip(pooled, norms))
        return q, k, v, grids[0], grids[1]

    def grids(self, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The pooled query and key grids of an input ``grid``."""
        def side(conv: nn.Conv2d | None, s: int) -> int:
            return s if conv is None else pooled_size(s, conv.kernel_size[0], conv.stride[0])

        return (side(self.pool_q, grid[0]), side(self.pool_q, grid[1])), (side(self.pool_k, grid[0]),
                                                                          side(self.pool_k, grid[1]))

    def context(self, q: torch.Tensor, q_grid: tuple[int, int], k_grid: tuple[int, int]) -> PoolingContext:
        """The kernel context: the relative terms from ``q`` (tables resampled for grids other
        than the model's own, logged once per grid pair)."""
        if self.rel_pos_h is None:
            return PoolingContext(q_grid, k_grid, self.prefix, residual=self.residual)
        want = (2 * max(q_grid[0], k_grid[0]) - 1, 2 * max(q_grid[1], k_grid[1]) - 1)
        have = (self.rel_pos_h.shape[0], self.rel_pos_w.shape[0])
        if have != want and (key := (id(self), q_grid, k_grid)) not in _LOGGED:
            _LOGGED.add(key)
            log.info("MViT relative position tables resampled for a %dx%d query / %dx%d key grid: rel_pos_h %d -> %d "
                     "rows, rel_pos_w %d -> %d rows", *q_grid, *k_grid, have[0], want[0], have[1], want[1])
        rh = gather_rel_pos(self.rel_pos_h, q_grid[0], k_grid[0])
        rw = gather_rel_pos(self.rel_pos_w, q_grid[1], k_grid[1])
        rel_h, rel_w = rel_pos_terms(q, q_grid, self.prefix, rh, rw)
        return PoolingContext(q_grid, k_grid, self.prefix, rel_h, rel_w, self.residual)

    def forward(self, x: torch.Tensor, grid: tuple[int, int],
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """``(B, prefix + H*W, dim)`` on ``grid`` -> ``(B, prefix + h*w, dim_out)`` and the pooled
        grid; with ``residual`` (``(B, prefix + h*w, dim_out)``) ``residual + attn(x)``, the add
        inside the output projection's GEMM."""
        q, k, v, q_grid, k_grid = self.pool(self.qkv(x), grid)
        out = self.kernel(q, k, v, self.context(q, q_grid, k_grid))
        return (self.proj(out) if residual is None else self.proj(out, residual=residual)), q_grid

    def probs(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Attention probabilities ``(B, H, prefix + h*w, prefix + kh*kw)`` float32, explicit."""
        q, k, _, q_grid, k_grid = self.pool(self.qkv(x), grid)
        return pooling_probs(q, k, self.context(q, q_grid, k_grid))
