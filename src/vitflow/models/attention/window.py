"""Window attention for Swin (Liu et al. 2021) and Swin V2 (Liu et al. 2022) through vitflow's
backends: the kernels and the position-bias / shift-mask tensors they add to the logits.

A window kernel maps the packed qkv projection of the windows ``(B*nW, N, 3*H*d)`` (``N``
tokens per window, windows of one image consecutive, timm's layout) to ``(B*nW, N, H*d)``,
given a :class:`WindowContext` whose ``bias`` is ``(nW, H, N, N)`` (relative position bias plus
the shifted-window mask, one tensor per block and input shape) or ``(1, H, N, N)`` (no shift:
the bias alone, shared by every window). Backends (``model.attention``):

- ``sdpa``: ``F.scaled_dot_product_attention`` with the bias as a float ``attn_mask``; windows
  are folded into the head axis (``(B, nW*H, N, d)``) so that the ``(nW*H, N, N)`` bias
  broadcasts over the batch without being copied per image;
- ``math``: explicit ``softmax(Q K^T * scale + bias) V`` (:class:`WindowMathKernel`);
- ``fused``: vitflow's C++ CPU kernel (:mod:`vitflow.models.kernels.cpp`): each (window, head)
  computed in the cache straight from the packed projection into the merged-head layout (no layout
  copies, no logits tensor), fp32 arithmetic; training saves the probabilities in the input's
  dtype (as ``math`` does) and the backward writes the qkv gradient in its layout and the bias
  gradient without a reduction pass; Swin V1 on float32 / bfloat16 CPU tensors without attention
  dropout, anything else (V2, CUDA, tracing for export) runs ``math``;
- ``auto``: times the backends above on the real shape, dtype and device
  (:class:`~vitflow.models.attention.AutoKernel`) and keeps the fastest (``fused`` only where the
  kernels could be built).

Swin V2's scaled cosine attention (``cos(q, k) * exp(min(logit_scale, ln 100))``) runs through
the same kernels: q and k are L2-normalised, q is multiplied by the per-head scale, and the
kernel's scale is 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vitflow.models.attention import AttentionContext, AttentionKernel, AutoKernel, packed_math_attention, split_heads
from vitflow.models.kernels import cpp
from vitflow.models.kernels.matmul import bias_gradient
from vitflow.timing import tracing

WINDOW_BACKENDS = ("sdpa", "math", "fused", "auto")
MASK_VALUE = -100.0  # the shifted-window mask's logit offset (the reference implementation's and timm's)
LOGIT_SCALE_MAX = math.log(1.0 / 0.01)  # Swin V2: the learned logit scale is clamped to <= 100


@dataclass(frozen=True)
class WindowContext(AttentionContext):
    """:class:`~vitflow.models.attention.AttentionContext` plus Swin V2's per-head logit scale
    ``(H, 1, 1)`` (``None``: Swin V1's scaled dot product). ``bias`` is ``(nW or 1, H, N, N)``.
    ``qkv_bias`` ``(3*H*d,)``: the projection's bias when ``qkv`` was computed with it detached;
    the kernel then gives it its gradient (the column sums of ``qkv``'s gradient: the fused kernel
    sums them while it writes that gradient, the others in :func:`with_bias_gradient`)."""

    logit_scale: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None


class _BiasGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, bias):
        ctx.dtype = bias.dtype
        return qkv.view_as(qkv)

    @staticmethod
    def backward(ctx, grad):
        return grad, bias_gradient(grad.reshape(-1, grad.shape[-1])).to(ctx.dtype)


def with_bias_gradient(qkv: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """``qkv`` unchanged, with ``ctx.qkv_bias`` (if any) receiving the column sums of its gradient
    as the native bf16 linear layer's backward computes them (:func:`~vitflow.models.kernels.matmul.bias_gradient`)."""
    bias = getattr(ctx, "qkv_bias", None)
    return qkv if bias is None else _BiasGradient.apply(qkv, bias)


def prepare_qkv(qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> tuple[torch.Tensor, ...]:
    """q, k, v ``(B*nW, H, N, d)`` (views of the packed ``qkv``) and the logit scale; for Swin V2
    (``ctx.logit_scale`` set) q and k L2-normalised, q times the clamped per-head scale, scale 1."""
    q, k, v = split_heads(qkv, num_heads)
    scale = getattr(ctx, "logit_scale", None)
    if scale is None:
        return q, k, v, q.shape[-1] ** -0.5
    scale = torch.clamp(scale, max=LOGIT_SCALE_MAX).exp().to(q.dtype)
    return F.normalize(q, dim=-1) * scale, F.normalize(k, dim=-1), v, 1.0


class WindowSdpaKernel(AttentionKernel):
    """Window attention by ``F.scaled_dot_product_attention`` (see the module docstring)."""

    def forward(self, qkv, num_heads, ctx):
        q, k, v, scale = prepare_qkv(with_bias_gradient(qkv, ctx), num_heads, ctx)
        bw, h, n, d = q.shape
        bias = ctx.bias.to(q.dtype)
        nw = bias.shape[0]
        if nw == 1:  # one bias for every window: 4-D as it is
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=ctx.dropout_p, scale=scale)
            return out.transpose(1, 2).reshape(bw, n, h * d)
        b = bw // nw
        q, k, v = (t.reshape(b, nw * h, n, d) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.reshape(1, nw * h, n, n),
                                             dropout_p=ctx.dropout_p, scale=scale)
        return out.view(bw, h, n, d).transpose(1, 2).reshape(bw, n, h * d)


def window_probs(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + bias)`` per window: q, k ``(B*nW, H, N, d)``, bias
    ``(nW or 1, H, N, N)`` -> ``(B*nW, H, N, N)`` in the promoted dtype of the logits and the
    bias (a float32 bias keeps bf16 logits' softmax in float32, as timm's; faster on the CPU too)."""
    bw, h, n, _ = q.shape
    nw = bias.shape[0]
    s = (q * scale) @ k.transpose(-2, -1)
    s = s.view(bw // nw, nw, h, n, n) + bias
    return s.softmax(dim=-1).view(bw, h, n, n)


class WindowMathKernel(AttentionKernel):
    """Explicit window attention. Swin V1 without attention dropout runs
    :func:`~vitflow.models.attention.packed_math_attention` (one copy lays out q, k, v; the bias
    shared by the images' windows; softmax in the logits' dtype, bf16 under autocast, as the
    plain ViT's ``math``; a hand-written backward); Swin V2 (cosine attention) and attention
    dropout run the ops below with autograd through each."""

    def forward(self, qkv, num_heads, ctx):
        qkv = with_bias_gradient(qkv, ctx)
        if getattr(ctx, "logit_scale", None) is None and ctx.dropout_p == 0.0:
            bw, n, _ = qkv.shape
            nw = ctx.bias.shape[0]
            return packed_math_attention(qkv, num_heads, ctx.bias.reshape(nw * num_heads, n, n), bw // nw)
        q, k, v, scale = prepare_qkv(qkv, num_heads, ctx)
        bw, h, n, d = q.shape
        p = window_probs(q, k, ctx.bias, scale)
        if ctx.dropout_p > 0.0:
            p = F.dropout(p, p=ctx.dropout_p)
        return (p.to(v.dtype) @ v).transpose(1, 2).reshape(bw, n, h * d)


class _FusedWindowAttention(torch.autograd.Function):
    """:func:`fused_window_attention` with its backward (the C++ kernels' pair)."""

    @staticmethod
    def forward(ctx, qkv, bias, qkv_bias, num_heads: int, scale: float):
        out, probs = cpp.ops().window_attention_forward(qkv, bias, num_heads, scale, True)
        ctx.save_for_backward(qkv, bias, probs)
        ctx.num_heads, ctx.scale = num_heads, scale
        ctx.qkv_bias_dtype = None if qkv_bias is None else qkv_bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        qkv, bias, probs = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dqkv, dbias, colsum = cpp.ops().window_attention_backward(
            grad.contiguous(), qkv, bias, probs, ctx.num_heads, ctx.scale, needs[1])
        return (dqkv, dbias if needs[1] else None, colsum.to(ctx.qkv_bias_dtype) if needs[2] else None,
                None, None)


def fused_window_attention(qkv: torch.Tensor, num_heads: int, bias: torch.Tensor | None = None,
                           qkv_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + bias) v`` per window and head by vitflow's C++ kernel.

    Args:
        qkv: ``(B*nW, N, 3*H*d)`` float32 or bfloat16 on the CPU, windows of one image consecutive.
        bias: ``(nW or 1, H, N, N)`` (window ``w`` uses ``bias[w % nW]``) or None; differentiable.
        qkv_bias: see :class:`WindowContext` (its gradient: the column sums of ``qkv``'s, summed
            by the backward kernel as it writes ``qkv``'s gradient).
    Returns:
        ``(B*nW, N, H*d)`` in ``qkv``'s dtype (arithmetic in float32; with autograd the
        probabilities ``(B*nW, H, N, N)`` in that dtype are kept for the backward).
    Raises:
        RuntimeError: the kernels could not be built here (:func:`vitflow.models.kernels.cpp.available`).
    """
    d = qkv.shape[-1] // (3 * num_heads)
    bias = qkv.new_empty(0, dtype=torch.float32) if bias is None else bias.float().contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, bias, qkv_bias)):
        return _FusedWindowAttention.apply(qkv.contiguous(), bias, qkv_bias, num_heads, d ** -0.5)
    return cpp.ops().window_attention_forward(qkv.contiguous(), bias, num_heads, d ** -0.5, False)[0]


class WindowFusedKernel(WindowMathKernel):
    """Window attention by :func:`fused_window_attention` where it applies (Swin V1, no attention
    dropout, float32 / bfloat16 CPU tensors, not tracing), else :class:`WindowMathKernel`. The
    kernels are built (or found built) at construction, never inside a forward."""

    def __init__(self):
        super().__init__()
        cpp.available()

    def forward(self, qkv, num_heads, ctx):
        if (getattr(ctx, "logit_scale", None) is None and ctx.dropout_p == 0.0 and qkv.device.type == "cpu"
                and qkv.dtype in (torch.float32, torch.bfloat16) and not tracing() and cpp.available()):
            return fused_window_attention(qkv, num_heads, ctx.bias, getattr(ctx, "qkv_bias", None))
        return super().forward(qkv, num_heads, ctx)


def make_window_kernel(name: str) -> AttentionKernel:
    """The window-attention backend ``name`` (``sdpa``, ``math``, ``fused`` or ``auto``; ``auto``
    chooses among the first three, ``fused`` only where :func:`cpp.available`).

    Raises:
        ValueError: another name (``model.attention`` named, with the choices).
    """
    if name == "sdpa":
        return WindowSdpaKernel()
    if name == "math":
        return WindowMathKernel()
    if name == "fused":
        return WindowFusedKernel()
    if name == "auto":
        candidates = {"sdpa": WindowSdpaKernel(), "math": WindowMathKernel()}
        if cpp.available():
            candidates["fused"] = WindowFusedKernel()
        return AutoKernel(candidates)
    raise ValueError(f"model.attention={name!r} is not available for Swin models: window attention runs on "
                     f"{', '.join(WINDOW_BACKENDS)} (sparse, linear and blockwise kernels assume a full token grid)")


def relative_position_index(window: tuple[int, int]) -> torch.Tensor:
    """``(N, N)`` long: the index into a ``(2*wh-1)*(2*ww-1)`` table of each (query, key) pair's
    offset inside a ``window`` (row-major tokens), as the reference implementation's."""
    wh, ww = window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1


def log_spaced_coords(window: tuple[int, int], pretrained_window: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Swin V2's continuous position inputs ``(1, 2*wh-1, 2*ww-1, 2)`` float32: offsets normalised
    by ``pretrained_window - 1`` (or ``window - 1``), times 8, then ``sign(x) log2(|x| + 1) / 3``
    (Liu et al. 2022, eq. 4)."""
    wh, ww = window
    norm = pretrained_window if pretrained_window[0] > 0 else window
    t = torch.stack(torch.meshgrid(torch.arange(-(wh - 1), wh, dtype=torch.float32),
                                   torch.arange(-(ww - 1), ww, dtype=torch.float32), indexing="ij"), dim=-1)
    t = t / torch.tensor([max(norm[0] - 1, 1), max(norm[1] - 1, 1)], dtype=torch.float32) * 8
    return (torch.sign(t) * torch.log2(t.abs() + 1.0) / math.log2(8)).unsqueeze(0)


def shift_mask(padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
               device: torch.device | None = None) -> torch.Tensor:
    """The shifted-window mask ``(nW, 1, N, N)`` float32 of a cyclically shifted ``padded``
    ``(Hp, Wp)`` grid: 0 between tokens of the same region before the shift, :data:`MASK_VALUE`
    between tokens that the roll brought together (Liu et al. 2021, sec. 3.2)."""
    hp, wp = padded
    img = torch.zeros(hp, wp, device=device)
    cnt = 0
    for hs in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):
        for ws in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
            img[hs[0]:hs[1], ws[0]:ws[1]] = cnt
            cnt += 1
    regions = img.view(hp // window[0], window[0], wp // window[1], window[1]).transpose(1, 2)
    regions = regions.reshape(-1, window[0] * window[1])
    diff = regions[:, None, :] - regions[:, :, None]
    return torch.where(diff != 0, MASK_VALUE, 0.0).unsqueeze(1)


def window_partition(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """``(B, H, W, C)`` (H, W multiples of the window) -> ``(B*nW, wh*ww, C)``, windows row-major
    per image (one copy)."""
    b, h, w, c = x.shape
    x = x.view(b, h // window[0], window[0], w // window[1], window[1], c).transpose(2, 3)
    return x.reshape(-1, window[0] * window[1], c)


def window_reverse(windows: torch.Tensor, window: tuple[int, int], h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: ``(B*nW, wh*ww, C)`` -> ``(B, h, w, C)`` (one copy)."""
    c = windows.shape[-1]
    x = windows.view(-1, h // window[0], w // window[1], window[0], window[1], c).transpose(2, 3)
    return x.reshape(-1, h, w, c)


def shifted_window_order(grid: tuple[int, int], window: tuple[int, int], shift: tuple[int, int],
                         device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The token permutation of a cyclic shift followed by :func:`window_partition`, for a grid
    ``(h, w)`` of whole windows: ``order`` (long ``(h*w,)``, the row-major grid index of each
    window slot) and its inverse. ``x[:, order]`` is ``window_partition(roll(x, -shift))`` in one
    copy instead of two; ``y[:, inverse]`` undoes it."""
    h, w = grid
    pos = torch.arange(h * w, device=device).view(1, h, w, 1)
    pos = torch.roll(pos, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    order = window_partition(pos, window).reshape(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(h * w, device=device)
    return order, inverse


class _PermuteTokens(torch.autograd.Function):
    """``x.index_select(1, order)`` whose backward is the inverse gather (a permutation: no
    scatter-add needed)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(1, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(1, inverse), None, None


def permute_tokens(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Tokens ``(B, L, C)`` reordered by the permutation ``order`` (``inverse`` its inverse)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _PermuteTokens.apply(x, order, inverse)
    return x.index_select(1, order)
