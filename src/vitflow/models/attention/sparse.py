"""Sparse attention patterns on the 2-D patch grid: ``local`` windows and ``axial`` rows/columns.

Patch token ``(y, x)`` attends to
- ``local``: the patches with ``|y' - y| <= r`` and ``|x' - x| <= r`` (a ``(2r+1)^2`` window,
  as in Stand-Alone Self-Attention, Ramachandran et al. 2019, and HaloNet);
- ``axial``: the patches of its row and of its column (Axial Attention, Ho et al. 2019;
  CCNet's criss-cross pattern, in one step);
and every token attends to the class token, which attends to everything.

Two implementations, picked per call:
- FlexAttention (``torch.nn.attention.flex_attention`` with a block mask, compiled), which
  skips key blocks with no allowed pair. Used on CUDA. On CPU torch 2.14 compiles it for
  inference only (no backward), and there it measured slower than masked SDPA (N=1025, r=3,
  52% block sparsity: 65 vs 44 ms fp32, 81 vs 47 ms bf16), so the CPU default is masked SDPA.
- ``F.scaled_dot_product_attention`` with the boolean pattern as ``attn_mask``: exact and
  differentiable on every device, but it computes every logit.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from vitflow.models.attention.core import AttentionContext, AttentionKernel, sdpa_attention

Pattern = Literal["local", "axial"]


def grid_mask(pattern: Pattern, grid: tuple[int, int], num_prefix_tokens: int = 1, radius: int = 3,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``(P + h*w, P + h*w)``: which keys (columns) each query (row) may attend to.

    Raises:
        ValueError: unknown ``pattern`` or a negative ``radius``.
    """
    if radius < 0:
        raise ValueError(f"attention window radius must be >= 0, got {radius}")
    h, w = grid
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy, dx = (ys[:, None] - ys[None, :]).abs(), (xs[:, None] - xs[None, :]).abs()
    if pattern == "local":
        patches = (dy <= radius) & (dx <= radius)
    elif pattern == "axial":
        patches = (dy == 0) | (dx == 0)
    else:
        raise ValueError(f"unknown sparse attention pattern {pattern!r}; choose 'local' or 'axial'")
    p = num_prefix_tokens
    mask = torch.ones(p + h * w, p + h * w, dtype=torch.bool, device=device)
    mask[p:, p:] = patches
    return mask


_flex_compiled = None


def _flex():
    """``torch.compile(flex_attention)`` (built once), or ``None`` where torch has no FlexAttention."""
    global _flex_compiled
    if _flex_compiled is None:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:
            return None
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


class SparseKernel(AttentionKernel):
    """``local`` / ``axial`` attention (see the module docstring).

    Args:
        pattern: ``"local"`` or ``"axial"``.
        radius: half-width of the local window in patches (``local`` only).
        impl: ``"auto"`` (FlexAttention on CUDA without bias or dropout, else masked SDPA),
            ``"flex"`` or ``"sdpa"``.
    Raises:
        ValueError: bad pattern / radius / impl; ``impl="flex"`` where FlexAttention cannot run
        (no FlexAttention in torch, or a CPU backward).
    """

    exact = False

    def __init__(self, pattern: Pattern, radius: int = 3, impl: Literal["auto", "flex", "sdpa"] = "auto"):
        super().__init__()
        if impl not in ("auto", "flex", "sdpa"):
            raise ValueError(f"sparse attention impl must be auto, flex or sdpa, got {impl!r}")
        grid_mask(pattern, (1, 1), 0, radius)  # validates pattern and radius
        self.pattern, self.radius, self.impl = pattern, radius, impl
        self._masks: dict = {}
        self._block_masks: dict = {}

    def mask(self, grid, num_prefix_tokens, device):
        key = (tuple(grid), num_prefix_tokens, str(device))
        if key not in self._masks:
            self._masks[key] = grid_mask(self.pattern, tuple(grid), num_prefix_tokens, self.radius, device)
        return self._masks[key]

    def _use_flex(self, q: torch.Tensor, ctx: AttentionContext) -> bool:
        if self.impl == "sdpa" or (self.impl == "auto" and not q.is_cuda):
            return False
        plain = ctx.bias is None and ctx.dropout_p == 0.0
        if self.impl == "auto":
            return plain and _flex() is not None
        if not plain:
            raise ValueError("sparse attention impl=flex supports neither a position bias nor attention dropout")
        if _flex() is None:
            raise ValueError("impl=flex: this torch has no torch.nn.attention.flex_attention")
        if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
            raise ValueError("impl=flex: FlexAttention has no CPU backward in this torch; use impl=sdpa for training")
        return True

    def _block_mask(self, dense: torch.Tensor):
        key = (dense.shape[0], str(dense.device), id(dense))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            n = dense.shape[0]
            self._block_masks[key] = create_block_mask(lambda b, h, qi, ki: dense[qi, ki], None, None, n, n,
                                                       device=dense.device)
        return self._block_masks[key]

    def attend(self, q, k, v, ctx):
        n = q.shape[-2]
        dense = self.mask(ctx.grid, ctx.num_prefix_tokens, q.device)
        if dense.shape[0] != n:
            raise ValueError(f"{self.pattern} attention: grid {ctx.grid} with {ctx.num_prefix_tokens} prefix "
                             f"token(s) does not give {n} tokens")
        if self._use_flex(q, ctx):
            return _flex()(q, k, v, block_mask=self._block_mask(dense))
        if ctx.bias is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=ctx.dropout_p)
        return sdpa_attention(q, k, v, ctx.dropout_p, ctx.bias.masked_fill(~dense, float("-inf")))

    def extra_repr(self) -> str:
        return f"pattern={self.pattern}, radius={self.radius}, impl={self.impl}"
