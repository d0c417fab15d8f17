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

from vitflow.models.attention.core import AttentionContext, AttentionKernel, _pack, _scaled_bmm, _unpack, _unpack_grad


def _block_scores(q: torch.Tensor, kj: torch.Tensor, attn_bias: torch.Tensor | None, b: int, j: int) -> torch.Tensor:
    """fp32 ``(B*H, N, bk)`` logits ``Q K_j^T / sqrt(d) (+ bias)`` against key block ``kj`` at ``j``."""
    s = _scaled_bmm(q, kj.transpose(1, 2), q.shape[-1] ** -0.5).float()
    if attn_bias is not None:
        bh, n, bk = s.shape
        s.view(b, bh // b, n, bk).add_(attn_bias[..., j:j + bk])
    return s


class _BlockwiseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, attn_bias, num_heads: int, block: int):
        b = qkv.shape[0]
        packed = _pack(qkv, num_heads)
        q, k, v = packed.unbind(0)
        bh, n, d = q.shape
        m = q.new_full((bh, n, 1), float("-inf"), dtype=torch.float32)
        l = q.new_zeros((bh, n, 1), dtype=torch.float32)
        acc = q.new_zeros((bh, n, d), dtype=torch.float32)
        for j in range(0, k.shape[1], block):
            kj, vj = k[:, j:j + block], v[:, j:j + block]
            s = _block_scores(q, kj, attn_bias, b, j)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s.sub_(m_new))
            corr = torch.exp(m - m_new)
            l = l.mul_(corr).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(corr).add_(torch.bmm(p.to(vj.dtype), vj).float())
            m = m_new
        out = acc.div_(l).to(q.dtype)
        lse = m.add_(l.log_())
        ctx.save_for_backward(packed, out, lse, attn_bias)
        ctx.b, ctx.num_heads, ctx.block = b, num_heads, block
        return _unpack(out, b)

    @staticmethod
    def backward(ctx, grad):
        packed, out, lse, attn_bias = ctx.saved_tensors
        b, h, block = ctx.b, ctx.num_heads, ctx.block
        q, k, v = packed.unbind(0)
        bh, n, d = q.shape
        g = grad.view(b, n, h, d).transpose(1, 2).reshape(bh, n, d).to(v.dtype)
        delta = (g.float() * out.float()).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dpacked = torch.empty_like(packed)
        need_attn = attn_bias is not None and ctx.needs_input_grad[1]
        dattn = torch.zeros_like(attn_bias, dtype=torch.float32) if need_attn else None
        for j in range(0, k.shape[1], block):
            kj, vj = k[:, j:j + block], v[:, j:j + block]
            p = torch.exp(_block_scores(q, kj, attn_bias, b, j).sub_(lse))
            torch.bmm(p.transpose(1, 2).to(v.dtype), g, out=dpacked[2, :, j:j + block])
            ds = p.mul_(torch.bmm(g, vj.transpose(1, 2)).float().sub_(delta))
            if need_attn:
                bk = ds.shape[-1]
                dattn[..., j:j + bk] += ds.view(b, h, n, bk).sum(0).reshape(dattn[..., j:j + bk].shape)
            ds_lp = ds.to(q.dtype)
            dq.add_(torch.bmm(ds_lp, kj).float())
            _scaled_bmm(ds_lp.transpose(1, 2), q, d ** -0.5, out=dpacked[1, :, j:j + block])
        torch.mul(dq, d ** -0.5, out=dpacked[0])
        return _unpack_grad(dpacked, b, h), dattn.to(attn_bias.dtype) if need_attn else None, None, None


def blockwise_attention(qkv: torch.Tensor, num_heads: int, attn_bias: torch.Tensor | None = None,
                        block_size: int = 128) -> torch.Tensor:
    """Exact softmax attention over key blocks (see the module docstring).

    Args:
        qkv: packed projection ``(B, N, 3*H*d)``.
        attn_bias: additive logit bias ``(H, N, N)`` or ``None``.
        block_size: keys per block; peak extra memory ``~ B*H*N*block_size`` fp32 values.
    Returns:
        ``(B, N, H*d)`` in qkv's dtype.
    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return _BlockwiseAttentionFn.apply(qkv, attn_bias, num_heads, block_size)


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
        return blockwise_attention(qkv, num_heads, ctx.bias, self.block_size)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}"
