"""Exact attention in key blocks with an online softmax: memory ``O(N * block)``, not ``O(N^2)``.

The forward pass walks the keys in blocks of ``block_size`` and keeps, per query, a running
maximum ``m``, a running normaliser ``l`` and an unnormalised output ``acc`` (Rabe & Staats 2021,
"Self-attention Does Not Need O(n^2) Memory"; the recurrence of FlashAttention, Dao et al. 2022):

    s_j = Q K_j^T / sqrt(d) + bias_j;  m' = max(m, rowmax s_j);  p_j = exp(s_j - m')
    l = l * exp(m - m') + rowsum p_j;  acc = acc * exp(m - m') + p_j V_j;  m = m'
    O = acc / l,  logsumexp L = m + log l

Only ``Q, K, V, O, L`` are saved; the backward recomputes ``P_j = exp(s_j - L)`` block by block
(FlashAttention backward: ``dV_j = P_j^T dO``, ``dS_j = P_j * (dO V_j^T - rowsum(dO * O))``,
``dQ += dS_j K_j / sqrt(d)``, ``dK_j = dS_j^T Q / sqrt(d)``). Statistics are kept in fp32.
"""

from __future__ import annotations

import torch

from vitflow.models.attention.core import AttentionContext, AttentionKernel, _pack, _unpack


def _block_scores(q: torch.Tensor, kj: torch.Tensor, bias: torch.Tensor | None, b: int, j: int,
                  scale: float) -> torch.Tensor:
    """fp32 ``(B*H, N, bk)`` logits of all queries against key block ``kj`` starting at ``j``."""
    s = torch.bmm(q, kj.transpose(1, 2)).float()
    if scale != 1.0:
        s.mul_(scale)
    if bias is not None:
        bh, n, bk = s.shape
        s.view(b, bh // b, n, bk).add_(bias[..., j:j + bk])
    return s


class _BlockwiseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, b: int, block: int, scale: float):
        bh, n, d = q.shape
        m = q.new_full((bh, n, 1), float("-inf"), dtype=torch.float32)
        l = q.new_zeros((bh, n, 1), dtype=torch.float32)
        acc = q.new_zeros((bh, n, d), dtype=torch.float32)
        for j in range(0, k.shape[1], block):
            kj, vj = k[:, j:j + block], v[:, j:j + block]
            s = _block_scores(q, kj, bias, b, j, scale)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s.sub_(m_new))
            corr = torch.exp(m - m_new)
            l = l.mul_(corr).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(corr).add_(torch.bmm(p.to(vj.dtype), vj).float())
            m = m_new
        out = acc.div_(l).to(q.dtype)
        lse = m.add_(l.log_())
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.b, ctx.block, ctx.scale = b, block, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, bias = ctx.saved_tensors
        b, block, scale = ctx.b, ctx.block, ctx.scale
        grad = grad.contiguous()
        delta = (grad.float() * out.float()).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        need_bias = bias is not None and ctx.needs_input_grad[3]
        dbias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        g = grad.to(v.dtype)
        for j in range(0, k.shape[1], block):
            kj, vj = k[:, j:j + block], v[:, j:j + block]
            p = torch.exp(_block_scores(q, kj, bias, b, j, scale).sub_(lse))
            dv[:, j:j + block] = torch.bmm(p.transpose(1, 2).to(v.dtype), g)
            ds = p.mul_(torch.bmm(g, vj.transpose(1, 2)).float().sub_(delta))
            if need_bias:
                bh, n, bk = ds.shape
                dbias[..., j:j + bk] += ds.view(b, bh // b, n, bk).sum(0).reshape(dbias[..., j:j + bk].shape)
            ds_lp = ds.to(q.dtype)
            dq.add_(torch.bmm(ds_lp, kj).float(), alpha=scale)
            dk[:, j:j + block] = torch.bmm(ds_lp.transpose(1, 2), q)
            if scale != 1.0:
                dk[:, j:j + block].mul_(scale)
        return dq.to(q.dtype), dk, dv, dbias.to(bias.dtype) if need_bias else None, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                        block_size: int = 128, batch: int = 1, scale: float | None = None) -> torch.Tensor:
    """Exact softmax attention over key blocks (see the module docstring).

    Args:
        q, k, v: contiguous ``(B*H, N, d)`` (any float dtype, all the same).
        bias: additive, broadcastable to ``(B, H, N, M)`` with ``B = batch``.
        block_size: keys per block; peak extra memory ``~ B*H*N*block_size`` fp32 values.
        scale: logit scale; default ``1/sqrt(d)`` (1.0 for an already scaled q).
    Returns:
        ``(B*H, N, d)`` in q's dtype.
    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _BlockwiseAttentionFn.apply(q, k, v, bias, batch, block_size, scale)


class BlockwiseKernel(AttentionKernel):
    """``blockwise``: exact attention with memory ``O(N * block_size)`` (no attention dropout)."""

    def __init__(self, block_size: int = 128):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"attention block size must be >= 1, got {block_size}")
        self.block_size = block_size

    def forward(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> torch.Tensor:
        if ctx.dropout_p > 0.0:
            raise ValueError("attention=blockwise does not support attention dropout; use math or sdpa")
        b = qkv.shape[0]
        q, k, v = _pack(qkv, num_heads).unbind(0)  # q comes pre-scaled
        return _unpack(blockwise_attention(q, k, v, ctx.bias, self.block_size, b, scale=1.0), b)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}"
