"""Pooling attention (MViTv2, Li et al. 2022, "MViTv2: Improved Multiscale Vision Transformers for
Classification and Detection", sec. 4.1): attention between pooled queries and pooled keys /
values, with decomposed relative position embeddings and the residual pooling connection.

A kernel here maps pooled, normalised ``q`` ``(B, H, Nq, d)`` and ``k``, ``v`` ``(B, H, Nk, d)``
(head-major, contiguous; ``num_prefix_tokens`` class tokens first, then the row-major grids
``ctx.q_grid`` / ``ctx.k_grid``) to the merged heads ``(B, Nq, H*d)``:

    S = q k^T / sqrt(d) + B_rel,   B_rel[(i, j), (k, l)] = q_(i,j) . (R_h[i - k] + R_w[j - l])
    out = softmax(S) v + q                     (the residual pooling connection, eq. 4)

The decomposed relative position term (eq. 3; timm's ``cal_rel_pos_type``) is added between grid
tokens only; ``R_h`` ``(qh, kh, d)`` and ``R_w`` ``(qw, kw, d)`` are the tables gathered at each
pair's offset (:func:`gather_rel_pos`), offsets scaled when the two grids differ in size. The
two per-query terms ``rel_h`` ``(B, H, qh, qw, kh)`` and ``rel_w`` ``(B, H, qh, qw, kw)``
(:func:`rel_pos_terms`) are computed once, outside the kernels, with autograd.

Backends (``model.attention``):

- ``sdpa``: ``F.scaled_dot_product_attention`` with the relative term as its float mask
  (``(B, H, Nq, Nk)``, materialised; with gradients PyTorch runs its math path there);
- ``math``: explicit attention (:func:`pooling_math_attention`): the logits by one batched GEMM,
  the relative term added by broadcasting or, in bf16, inside that GEMM of operands widened by
  ``kh + kw`` columns (:func:`_logits`), softmax, and the residual added inside the ``P V`` GEMM
  (``baddbmm``); training runs a hand-written backward;
- ``auto``: times both on the first call of each shape (:class:`PoolingAutoKernel`) and keeps
  the faster.

``residual``: ``"all"`` adds q to every output row (timm, the image MViTv2), ``"grid"`` to the
grid rows only (torchvision / PySlowFast: not to the class token), ``"none"`` disables it.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vitflow.models.attention.auto import _CHOICES, _FORCED, AutoKernel, _record
from vitflow.models.attention.core import AttentionKernel, _scaled_bmm, merge_heads
from vitflow.timing import sync

log = logging.getLogger(__name__)

POOLING_BACKENDS = ("sdpa", "math", "auto")
RESIDUAL_MODES = ("all", "grid", "none")


@dataclass(frozen=True)
class PoolingContext:
    """What a pooling-attention kernel needs beside q, k, v.

    Attributes:
        q_grid, k_grid: the pooled query and key grids ``(h, w)``.
        num_prefix_tokens: class tokens before each grid (0 or 1).
        rel_h, rel_w: the decomposed relative terms ``(B, H, qh, qw, kh)`` / ``(B, H, qh, qw, kw)``
            (:func:`rel_pos_terms`), or ``None`` for no relative position embedding.
        residual: ``"all"``, ``"grid"`` or ``"none"`` (see the module docstring).
    """

    q_grid: tuple[int, int]
    k_grid: tuple[int, int]
    num_prefix_tokens: int = 0
    rel_h: torch.Tensor | None = None
    rel_w: torch.Tensor | None = None
    residual: str = "all"


def rel_pos_index(q_size: int, k_size: int, device: torch.device | None = None) -> torch.Tensor:
    """``(q_size, k_size)`` long: the table row of each (query, key) offset along one axis; the
    coarser grid's coordinates are scaled up to the finer one's (MViTv2 sec. 4.1; the arithmetic
    of timm's ``cal_rel_pos_type``, float32 then truncated, so indices agree exactly)."""
    q_ratio, k_ratio = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)
    dist = (torch.arange(q_size, device=device, dtype=torch.long).unsqueeze(-1) * q_ratio
            - torch.arange(k_size, device=device, dtype=torch.long).unsqueeze(0) * k_ratio)
    dist += (k_size - 1) * k_ratio
    return dist.long()


def resample_rel_pos(table: torch.Tensor, length: int) -> torch.Tensor:
    """A relative position table ``(L, d)`` linearly resampled to ``(length, d)`` (align_corners
    off: torchvision's / PySlowFast's ``_interpolate`` at run time, timm's ``checkpoint_filter_fn``
    at load time); ``table`` itself when ``L == length``."""
    if table.shape[0] == length:
        return table
    out = F.interpolate(table.t().unsqueeze(0).float(), size=length, mode="linear")
    return out.squeeze(0).t().to(table.dtype)


def gather_rel_pos(table: torch.Tensor, q_size: int, k_size: int) -> torch.Tensor:
    """The table rows of every (query, key) pair along one axis: ``(q_size, k_size, d)``; a table
    whose length is not ``2 max(q_size, k_size) - 1`` is resampled first (:func:`resample_rel_pos`)."""
    table = resample_rel_pos(table, 2 * max(q_size, k_size) - 1)
    return table[rel_pos_index(q_size, k_size, table.device)]


def rel_pos_terms(q: torch.Tensor, q_grid: tuple[int, int], num_prefix_tokens: int, rh: torch.Tensor,
                  rw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rel_h = q . R_h`` ``(B, H, qh, qw, kh)`` and ``rel_w = q . R_w`` ``(B, H, qh, qw, kw)`` for
    the grid queries of ``q`` ``(B, H, Nq, d)`` (unscaled, as in the paper), ``rh`` ``(qh, kh, d)``,
    ``rw`` ``(qw, kw, d)`` from :func:`gather_rel_pos`; dtype of the product (bf16 under autocast)."""
    b, h, _, d = q.shape
    qh, qw = q_grid
    r_q = q[:, :, num_prefix_tokens:].reshape(b, h, qh, qw, d)
    rel_h = torch.einsum("byhwc,hkc->byhwk", r_q, rh)
    rel_w = torch.einsum("byhwc,wkc->byhwk", r_q, rw)
    return rel_h, rel_w


def _add_rel(s: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    """Add the relative terms to the grid block of logits ``s`` ``(B*H, Nq, Nk)`` in place."""
    if ctx.rel_h is None:
        return s
    p, (qh, qw), (kh, kw) = ctx.num_prefix_tokens, ctx.q_grid, ctx.k_grid
    grid = s[:, p:, p:].view(-1, qh, qw, kh, kw)
    rel_h, rel_w = ctx.rel_h.to(s.dtype), ctx.rel_w.to(s.dtype)
    grid.add_(rel_h.reshape(-1, qh, qw, kh, 1)).add_(rel_w.reshape(-1, qh, qw, 1, kw))
    return s


def rel_bias(ctx: PoolingContext, dtype: torch.dtype, nq: int, nk: int) -> torch.Tensor | None:
    """The relative term as a dense additive mask ``(B, H, Nq, Nk)`` in ``dtype`` (zeros in the
    class-token rows and columns), or ``None``."""
    if ctx.rel_h is None:
        return None
    (qh, qw), (kh, kw) = ctx.q_grid, ctx.k_grid
    b, h = ctx.rel_h.shape[:2]
    bias = (ctx.rel_h.to(dtype).unsqueeze(-1) + ctx.rel_w.to(dtype).unsqueeze(-2)).reshape(b, h, qh * qw, kh * kw)
    p = ctx.num_prefix_tokens
    return F.pad(bias, (p, 0, p, 0)) if p else bias


def _residual(out: torch.Tensor, q: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    """``out + q`` per ``ctx.residual`` (``(B, H, Nq, d)`` both)."""
    if ctx.residual == "all":
        return out + q
    if ctx.residual == "grid":
        p = ctx.num_prefix_tokens
        return torch.cat((out[:, :, :p], out[:, :, p:] + q[:, :, p:]), dim=2)
    return out


def pooling_probs(q: torch.Tensor, k: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    """Attention probabilities ``(B, H, Nq, Nk)`` in float32, computed explicitly."""
    b, h, nq, _ = q.shape
    f32 = dataclasses.replace(ctx, rel_h=None if ctx.rel_h is None else ctx.rel_h.float(),
                              rel_w=None if ctx.rel_w is None else ctx.rel_w.float())
    return _logits(q.float(), k.float(), f32)[0].softmax(-1).view(b, h, nq, -1)


_ONE_HOT: dict[tuple, torch.Tensor] = {}


def _one_hot(k_grid: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(kh*kw, kh + kw)``: key ``(a, b)``'s row is ``[e_a | e_b]`` (cached per grid, dtype, device)."""
    key = (k_grid, dtype, str(device))
    if key not in _ONE_HOT:
        kh, kw = k_grid
        rows, cols = torch.arange(kh, device=device).repeat_interleave(kw), torch.arange(kw, device=device).repeat(kh)
        onehot = torch.zeros(kh * kw, kh + kw, dtype=dtype, device=device)
        onehot[torch.arange(kh * kw, device=device), rows] = 1
        onehot[torch.arange(kh * kw, device=device), kh + cols] = 1
        _ONE_HOT[key] = onehot
    return _ONE_HOT[key]


def _widen(q: torch.Tensor, ctx: PoolingContext) -> bool:
    """Whether :func:`_logits` puts the relative terms into the GEMM: for bf16 / fp16 logits, whose
    broadcast adds and sums run slowly on the CPU (measured on MViTv2-T's shapes, forward and
    backward: 1.3-1.7x faster widened in bf16, 0.8-1.0x in float32)."""
    return ctx.rel_h is not None and q.dtype in (torch.bfloat16, torch.float16)


def _logits(q: torch.Tensor, k: torch.Tensor, ctx: PoolingContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``S = q k^T / sqrt(d) + B_rel`` ``(B*H, Nq, Nk)`` and the operands of its batched GEMM.

    The relative term is added to the product by broadcasting (:func:`_add_rel`; operands q and k
    as ``(B*H, N, d)``), or, where :func:`_widen`, joins the product: ``q' = [q | rel_h sqrt(d) |
    rel_w sqrt(d)]`` and ``k' = [k | e_row | e_col]`` (one-hot key coordinates; zeros in
    class-token rows), so that ``q' k'^T / sqrt(d) = q k^T / sqrt(d) + rel_h[.., row] +
    rel_w[.., col]`` with no ``Nq x Nk`` broadcast adds (and, in the backward, no sums over the
    logits' gradient)."""
    b, h, nq, d = q.shape
    qf, kf = q.reshape(b * h, nq, d), k.reshape(b * h, -1, d)
    scale = d ** -0.5
    if not _widen(q, ctx):
        return _add_rel(_scaled_bmm(qf, kf.transpose(1, 2), scale), ctx), qf, kf
    p, (kh, kw) = ctx.num_prefix_tokens, ctx.k_grid
    qa = qf.new_empty(b * h, nq, d + kh + kw)
    ka = kf.new_empty(b * h, kf.shape[1], d + kh + kw)
    qa[..., :d] = qf
    ka[..., :d] = kf
    torch.mul(ctx.rel_h.reshape(b * h, -1, kh), 1.0 / scale, out=qa[:, p:, d:d + kh])
    torch.mul(ctx.rel_w.reshape(b * h, -1, kw), 1.0 / scale, out=qa[:, p:, d + kh:])
    ka[:, p:, d:] = _one_hot(ctx.k_grid, ka.dtype, ka.device)
    if p:
        qa[:, :p, d:] = 0
        ka[:, :p, d:] = 0
    return _scaled_bmm(qa, ka.transpose(1, 2), scale), qa, ka


class _PoolingMathFn(torch.autograd.Function):
    """Explicit pooling attention with a hand-written backward (see :func:`pooling_math_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, rel_h, rel_w, pctx: PoolingContext):
        b, h, nq, d = q.shape
        s, qa, ka = _logits(q, k, pctx)
        p = torch.softmax(s, dim=-1)
        vf = v.reshape(b * h, -1, d)
        out = _pv(p, vf, qa[..., :d], pctx)
        ctx.save_for_backward(qa, ka, vf, p)
        ctx.pctx = dataclasses.replace(pctx, rel_h=None, rel_w=None)  # the grids and modes, no tensors
        ctx.shape, ctx.rel_dtype = (b, h), None if rel_h is None else rel_h.dtype
        return out.view(b, h, nq, d)

    @staticmethod
    def backward(ctx, grad):
        qa, ka, vf, p = ctx.saved_tensors
        pctx, (b, h) = ctx.pctx, ctx.shape
        bh, nq, d = vf.shape[0], qa.shape[1], vf.shape[2]
        g = grad.reshape(bh, nq, d).to(vf.dtype)
        dv = torch.bmm(p.transpose(1, 2), g)
        ds = torch._softmax_backward_data(torch.bmm(g, vf.transpose(1, 2)), p, -1, p.dtype)
        res, scale = _residual_grad(g, pctx), d ** -0.5
        dk = _scaled_bmm(ds.transpose(1, 2), qa[..., :d], scale)
        drel_h = drel_w = None
        pr, (qh, qw), (kh, kw) = pctx.num_prefix_tokens, pctx.q_grid, pctx.k_grid
        if qa.shape[-1] > d:  # widened operands: q's gradient / scale, then the relative terms'
            dqa = torch.bmm(ds, ka)
            dq = dqa[..., :d] * scale if res is None else torch.add(res, dqa[..., :d], alpha=scale)
            drel_h, drel_w = dqa[:, pr:, d:d + kh], dqa[:, pr:, d + kh:]
        else:
            dq = _scaled_bmm(ds, ka, scale) if res is None else torch.baddbmm(res, ds, ka, alpha=scale)
            if ctx.rel_dtype is not None:
                dgrid = ds[:, pr:, pr:].reshape(bh, qh, qw, kh, kw)
                drel_h, drel_w = dgrid.sum(-1), dgrid.sum(-2)  # (bf16 sums accumulate in float32)
        if drel_h is not None:
            drel_h = drel_h.reshape(b, h, qh, qw, kh).to(ctx.rel_dtype)
            drel_w = drel_w.reshape(b, h, qh, qw, kw).to(ctx.rel_dtype)
        return dq.reshape(b, h, nq, d), dk.view(b, h, -1, d), dv.view(b, h, -1, d), drel_h, drel_w, None


def _pv(p: torch.Tensor, vf: torch.Tensor, qf: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    """``P V`` plus the residual q (``(B*H, Nq, d)``): the add inside the GEMM for ``all``."""
    if ctx.residual == "all":
        return torch.baddbmm(qf.to(p.dtype), p, vf.to(p.dtype))
    out = torch.bmm(p, vf.to(p.dtype))
    if ctx.residual == "grid":
        out[:, ctx.num_prefix_tokens:] += qf[:, ctx.num_prefix_tokens:]
    return out


def _residual_grad(g: torch.Tensor, ctx: PoolingContext) -> torch.Tensor | None:
    """The residual connection's share of q's gradient (``g`` itself for ``all``), or ``None``."""
    if ctx.residual == "all":
        return g
    if ctx.residual == "grid":
        out = g.clone()
        out[:, :ctx.num_prefix_tokens] = 0
        return out
    return None


def pooling_math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: PoolingContext) -> torch.Tensor:
    """Explicit pooling attention: q ``(B, H, Nq, d)``, k, v ``(B, H, Nk, d)`` -> ``(B, H, Nq, d)``
    (see the module docstring; softmax in the logits' dtype). With gradients a custom backward
    keeps only the logits' operands (:func:`_logits`), v and the probabilities: ``dV = P^T g``,
    ``dS = P * (g V^T - rowsum)``, ``dQ' = dS K'`` (``dQ = dQ'[:d] / sqrt(d) (+ g)``, the relative
    terms' gradients its other columns), ``dK = dS^T Q / sqrt(d)``."""
    tensors = (q, k, v, ctx.rel_h, ctx.rel_w)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _PoolingMathFn.apply(q, k, v, ctx.rel_h, ctx.rel_w, ctx)
    b, h, nq, d = q.shape
    s, qa, _ = _logits(q, k, ctx)
    return _pv(torch.softmax(s, dim=-1), v.reshape(b * h, -1, d), qa[..., :d], ctx).view(b, h, nq, d)


class PoolingMathKernel(AttentionKernel):
    """``math``: :func:`pooling_math_attention`, merged heads out."""

    def forward(self, q, k, v, ctx):
        return merge_heads(pooling_math_attention(q, k, v, ctx))


class PoolingSdpaKernel(AttentionKernel):
    """``sdpa``: ``F.scaled_dot_product_attention`` with the relative term as its float mask."""

    def forward(self, q, k, v, ctx):
        bias = rel_bias(ctx, q.dtype, q.shape[2], k.shape[2])
        return merge_heads(_residual(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), q, ctx))


def _time(kernel: AttentionKernel, q, k, v, ctx: PoolingContext, backward: bool, calls: int = 3) -> float:
    """Median seconds of ``calls`` runs of ``kernel`` on copies of the real inputs (after one
    warm-up), forward and, if ``backward``, backward; ``inf`` if it fails."""
    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(backward)

    q, k, v = leaf(q), leaf(k), leaf(v)
    tctx = PoolingContext(ctx.q_grid, ctx.k_grid, ctx.num_prefix_tokens, leaf(ctx.rel_h), leaf(ctx.rel_w),
                          ctx.residual)
    times = []
    try:
        for i in range(calls + 1):
            sync(q.device)
            t0 = time.perf_counter()
            out = kernel(q, k, v, tctx)
            if backward:
                out.backward(torch.ones_like(out))
            sync(q.device)
            if i:
                times.append(time.perf_counter() - t0)
    except (RuntimeError, ValueError) as e:
        log.warning("attention=auto: candidate %s failed, left out: %s", type(kernel).__name__, e)
        return float("inf")
    return statistics.median(times)


class PoolingAutoKernel(AutoKernel):
    """``auto`` for pooling attention: on the first call of each key (q and k shapes, dtype,
    device, autocast, backward) every candidate is timed on copies of the real inputs; the
    fastest (ties within 3% to the earlier: sdpa, math) is kept and logged."""

    def key(self, q, k, v, ctx) -> tuple:  # type: ignore[override]
        tensors = (q, k, v, ctx.rel_h, ctx.rel_w)
        backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), ctx.rel_h is not None, ctx.residual,
                torch.is_autocast_enabled(q.device.type), tuple(self.candidates), backward)

    def choose(self, q, k, v, ctx) -> str:  # type: ignore[override]
        key = self.key(q, k, v, ctx)
        if key not in _CHOICES:
            devices = [q.device] if q.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad() if key[-1] else torch.no_grad():
                times = {n: _time(c, q, k, v, ctx, key[-1]) for n, c in self.candidates.items()}
            _record(key, times, f"pooling attention, keys {tuple(k.shape)}")
        return _CHOICES[key]

    def forward(self, q, k, v, ctx):  # type: ignore[override]
        name = _FORCED.get()
        if name in self.candidates:
            return self.candidates[name](q, k, v, ctx)
        self.choice = self.choose(q, k, v, ctx)
        return self.candidates[self.choice](q, k, v, ctx)


def make_pooling_kernel(name: str) -> AttentionKernel:
    """The pooling-attention backend ``name`` (``sdpa``, ``math`` or ``auto``).

    Raises:
        ValueError: another name (``model.attention`` named, with the choices).
    """
    if name == "sdpa":
        return PoolingSdpaKernel()
    if name == "math":
        return PoolingMathKernel()
    if name == "auto":
        return PoolingAutoKernel({"sdpa": PoolingSdpaKernel(), "math": PoolingMathKernel()})
    raise ValueError(f"model.attention={name!r} is not available for MViT models: pooling attention runs on "
                     f"{', '.join(POOLING_BACKENDS)} (sparse, linear and blockwise kernels assume one token grid "
                     "for queries and keys)")
