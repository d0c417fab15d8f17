"""The kernel interface and the two reference backends, ``sdpa`` and ``math``.

A kernel maps the packed output of the qkv projection ``(B, N, 3 * H * d)`` (timm's layout:
q, k, v, each heads-major) to the merged heads ``(B, N, H * d)`` that feed the output
projection. Working on the packed tensor lets a kernel choose its own memory layout: the
``math`` kernel makes one copy of q, k and v, where an unfused implementation makes several.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionContext:
    """What a kernel may need beside q, k, v.

    Attributes:
        grid: the patch grid ``(h, w)`` of this input (sparse patterns, relative bias).
        num_prefix_tokens: class tokens before the grid tokens (0 or 1).
        bias: additive logit bias broadcastable to ``(B, H, N, N)`` (usually ``(H, N, N)``,
            the relative position bias) or ``None``.
        dropout_p: attention-probability dropout (0 outside training).
    """

    grid: tuple[int, int]
    num_prefix_tokens: int = 1
    bias: torch.Tensor | None = None
    dropout_p: float = 0.0


def split_heads(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q, k, v ``(B, H, N, d)`` of a packed ``(B, N, 3*H*d)`` projection (no copy)."""
    b, n, c = qkv.shape
    return qkv.view(b, n, 3, num_heads, c // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, d)`` -> ``(B, N, H*d)`` (a view when the heads are already token-major)."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def attention_probs(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities ``softmax(Q K^T / sqrt(d) + bias)`` (Vaswani et al. 2017, eq. 1).

    Args:
        q: ``(B, H, N, d)``; k: ``(B, H, M, d)``.
        bias: additive, broadcastable to ``(B, H, N, M)``.
        mask: bool, broadcastable to ``(N, M)``; ``False`` pairs get probability 0.
    Returns:
        ``(B, H, N, M)`` in q's dtype; rows sum to 1.
    """
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(dim=-1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``: FlashAttention / memory-efficient kernels on GPU, the
    fused flash kernel on CPU. q, k, v ``(B, H, N, d)`` -> ``(B, H, N, d)``; dtype preserved."""
    mask = None if bias is None else bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit ``softmax(Q K^T / sqrt(d) + bias) V`` with autograd through every op.
    q, k, v ``(B, H, N, d)`` -> ``(B, H, N, d)``; dtype preserved."""
    attn = attention_probs(q, k, bias)
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v


class AttentionKernel(nn.Module):
    """Base class of the attention backends.

    ``forward(qkv, num_heads, ctx)``: packed ``(B, N, 3*H*d)`` (the projection's output, bias
    included) -> ``(B, N, H*d)``, same dtype. Subclasses implement :meth:`attend` on per-head
    tensors, or override :meth:`forward`.

    Class attributes:
        exact: computes softmax attention over all keys (agrees with ``math`` up to rounding).
        supports_bias: accepts ``ctx.bias`` (relative position bias).
    """

    exact = True
    supports_bias = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q, k, v ``(B, H, N, d)`` -> ``(B, H, N, d)``."""
        raise NotImplementedError

    def forward(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> torch.Tensor:
        return merge_heads(self.attend(*split_heads(qkv, num_heads), ctx))

    def mask(self, grid: tuple[int, int], num_prefix_tokens: int, device: torch.device) -> torch.Tensor | None:
        """The bool ``(N, N)`` pattern of allowed (query, key) pairs; ``None`` = all pairs."""
        return None


class SdpaKernel(AttentionKernel):
    """``F.scaled_dot_product_attention`` (see :func:`sdpa_attention`)."""

    def attend(self, q, k, v, ctx):
        return sdpa_attention(q, k, v, ctx.dropout_p, ctx.bias)


def _pack(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, N, 3*H*d)`` -> a new contiguous ``(3, B*H, N, d)``: the layout the batched GEMMs need,
    in one permuting copy (the projection bias is already in ``qkv``: ``addmm`` adds it for free;
    the ``1/sqrt(d)`` scale is the GEMMs' ``alpha``). No autograd."""
    b, n, c = qkv.shape
    d = c // (3 * num_heads)
    src = qkv.view(b, n, 3, num_heads, d).permute(2, 0, 3, 1, 4)
    if torch.compiler.is_compiling():  # inductor fuses the functional form; out= would keep src's strides
        return src.contiguous().view(3, b * num_heads, n, d)
    packed = qkv.new_empty(3, b, num_heads, n, d)
    packed.copy_(src)
    return packed.view(3, b * num_heads, n, d)


def _unpack_grad(dpacked: torch.Tensor, b: int, num_heads: int) -> torch.Tensor:
    """The qkv gradient ``(B, N, 3*H*d)`` from the gradient of :func:`_pack`'s output (one copy)."""
    _, bh, n, d = dpacked.shape
    grad_src = dpacked.view(3, b, num_heads, n, d).permute(1, 3, 0, 2, 4)
    if torch.compiler.is_compiling():
        return grad_src.reshape(b, n, 3 * num_heads * d)
    dqkv = dpacked.new_empty(b, n, 3, num_heads, d)
    dqkv.copy_(grad_src)
    return dqkv.view(b, n, 3 * num_heads * d)


def _unpack(x: torch.Tensor, b: int) -> torch.Tensor:
    """``(B*H, N, d)`` -> ``(B, N, H*d)`` (one copy)."""
    bh, n, d = x.shape
    return x.view(b, bh // b, n, d).transpose(1, 2).reshape(b, n, bh // b * d)


def _scaled_bmm(a: torch.Tensor, b: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * (a @ b)`` for 3-D batches, the scale applied inside the GEMM (``baddbmm`` with
    ``beta=0``, whose ``input`` is then ignored)."""
    if torch.compiler.is_compiling() and out is None:  # inductor fuses the scale into the GEMM's epilogue
        return torch.bmm(a, b) * alpha
    shape = (a.shape[0], a.shape[1], b.shape[2])
    empty = a.new_empty(()).expand(shape)
    if out is None:
        return torch.baddbmm(empty, a, b, beta=0.0, alpha=alpha)
    return torch.baddbmm(empty, a, b, beta=0.0, alpha=alpha, out=out)


def _scores(q: torch.Tensor, k: torch.Tensor, attn_bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``Q K^T / sqrt(d) (+ attn_bias)`` as ``(B*H, N, M)``; the bias, broadcastable to
    ``(groups, B*H / groups, N, M)``, is rounded to the scores' dtype first (bf16 autocast: a
    mixed-dtype add runs ~4x slower on the CPU)."""
    s = _scaled_bmm(q, k.transpose(1, 2), q.shape[-1] ** -0.5)
    if attn_bias is not None:
        bh, n, m = s.shape
        s.view(groups, bh // groups, n, m).add_(attn_bias.to(s.dtype))
    return s


class _MathAttentionFn(torch.autograd.Function):
    """Explicit attention on the raw qkv projection with a hand-written backward.

    Forward: :func:`_pack`, ``P = softmax(Q K^T / sqrt(d) + bias)``, ``P V``. Saves the packed
    q, k, v and P; the backward is the standard one (dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dP * P)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)) followed by
    :func:`_unpack_grad`, which lays dQ, dK, dV out for the qkv projection's backward.
    """

    @staticmethod
    def forward(ctx, qkv, attn_bias, num_heads: int, groups: int):
        b = qkv.shape[0]
        packed = _pack(qkv, num_heads)
        q, k, v = packed.unbind(0)
        p = torch.softmax(_scores(q, k, attn_bias, groups), dim=-1)
        ctx.save_for_backward(packed, p, attn_bias)
        ctx.b, ctx.num_heads, ctx.groups = b, num_heads, groups
        return _unpack(torch.bmm(p, v), b)

    @staticmethod
    def backward(ctx, grad):
        packed, p, attn_bias = ctx.saved_tensors
        q, k, v = packed.unbind(0)
        b, h = ctx.b, ctx.num_heads
        bh, n, d = q.shape
        g = grad.view(b, n, h, d).transpose(1, 2).reshape(bh, n, d).to(v.dtype)
        dpacked = torch.empty_like(packed)
        torch.bmm(p.transpose(1, 2), g, out=dpacked[2])
        ds = torch._softmax_backward_data(torch.bmm(g, v.transpose(1, 2)), p, -1, p.dtype)
        _scaled_bmm(ds, k, d ** -0.5, out=dpacked[0])
        _scaled_bmm(ds.transpose(1, 2), q, d ** -0.5, out=dpacked[1])
        dattn = None
        if attn_bias is not None and ctx.needs_input_grad[1]:  # summed over what the bias was broadcast along
            full = ds.view(ctx.groups, bh // ctx.groups, n, n)
            if attn_bias.dim() < full.dim() or attn_bias.shape[0] == 1:  # shared by the groups (Swin's windows)
                full = full.sum(0, dtype=torch.float32, keepdim=attn_bias.dim() == full.dim())
            dattn = full.float().sum_to_size(attn_bias.shape).to(attn_bias.dtype)
        return _unpack_grad(dpacked, b, h), dattn, None, None


def packed_math_attention(qkv: torch.Tensor, num_heads: int, attn_bias: torch.Tensor | None = None,
                          groups: int | None = None) -> torch.Tensor:
    """Explicit softmax attention on a packed projection: ``(B, N, 3*H*d)`` -> ``(B, N, H*d)``.

    Args:
        qkv: the qkv projection (bias included).
        attn_bias: additive logit bias broadcastable to ``(B, H, N, N)``, or with ``groups`` to
            ``(groups, B*H / groups, N, N)``: Swin's windows pass their ``(nW*H, N, N)`` bias with
            ``groups = B / nW`` (the windows of one image consecutive), shared by every image
            without being copied per window.
        groups: see ``attn_bias`` (default ``B``).

    Same result as :func:`math_attention` on the split heads, with fewer passes over memory:
    one copy lays out q, k, v for batched GEMMs, the ``1/sqrt(d)`` scale is the GEMMs' ``alpha``;
    in training a custom backward keeps only q, k, v and the probabilities and writes the qkv
    gradient in one pass.
    """
    b = qkv.shape[0]
    groups = groups or b
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, attn_bias))
    if needs_grad:
        return _MathAttentionFn.apply(qkv, attn_bias, num_heads, groups)
    q, k, v = _pack(qkv, num_heads).unbind(0)
    return _unpack(torch.bmm(torch.softmax(_scores(q, k, attn_bias, groups), dim=-1), v), b)


class MathKernel(AttentionKernel):
    """Explicit softmax attention (:func:`packed_math_attention`; with attention dropout, the
    plain autograd :func:`math_attention`). On the project's 2-core CPU it trains a 65-token
    ViT ~2x faster than ``sdpa`` in bf16 (``shared/reference/cpu-baselines.md``)."""

    def forward(self, qkv, num_heads, ctx):
        if ctx.dropout_p > 0.0:
            return super().forward(qkv, num_heads, ctx)
        return packed_math_attention(qkv, num_heads, ctx.bias)

    def attend(self, q, k, v, ctx):
        return math_attention(q, k, v, ctx.dropout_p, ctx.bias)
