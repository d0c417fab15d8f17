"""The deployment copy of a model that every ONNX export starts from (:func:`deployable`): its
attention with separate q / k / v projections and an explicit ``softmax(q k^T / sqrt(d)) v``
(:class:`SplitQKVAttention`), the layout ONNX Runtime's transformer optimizer and TensorRT's
attention fusion recognise. The weights are the same (the fused qkv matrix split in three) and the
numbers agree to float rounding."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from vitflow.models.attention import EXACT_BACKENDS


class SplitQKVAttention(nn.Module):
    """Export form of :class:`vitflow.models.vit.model.Attention`: the fused ``qkv`` projection split
    into ``q``, ``k``, ``v`` linears and explicit attention (Vaswani et al. 2017, eq. 1), written
    in the op order of Hugging Face's ViT, which ONNX Runtime's ``FusionAttention`` matches.

    ``(B, N, D)`` -> ``(B, N, D)``; equal to the source module up to float rounding.
    """

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        inner = self.num_heads * self.head_dim
        dim = attn.qkv.in_features
        w, b = attn.qkv.weight.detach(), attn.qkv.bias
        self.q, self.k, self.v = (nn.Linear(dim, inner, bias=b is not None) for _ in range(3))
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight.data.copy_(w[i * inner:(i + 1) * inner])
            if b is not None:
                lin.bias.data.copy_(b.detach()[i * inner:(i + 1) * inner])
        self.proj = attn.proj

    attn_drop = 0.0  # (eval only)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``(B, H, N, d)`` (token merging reads the keys)."""
        b, n, _ = x.shape
        return tuple(lin(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                     for lin in (self.q, self.k, self.v))

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        q = self.q(x).reshape(b, n, h, d).transpose(1, 2)
        k = self.k(x).reshape(b, n, h, d).permute(0, 2, 3, 1)
        v = self.v(x).reshape(b, n, h, d).transpose(1, 2)
        attn = ((q @ k) / math.sqrt(d)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, h * d))


def _plain_attention(attn: nn.Module) -> bool:
    """True for an attention module holding only ``qkv`` and ``proj`` weights and computing exact
    softmax attention over all tokens (no position bias, sparse pattern or approximation this
    export form would drop)."""
    names = {n for n, _ in attn.named_parameters()}
    exact = getattr(attn, "backend", "sdpa") in (*EXACT_BACKENDS, "auto")
    return exact and hasattr(attn, "qkv") and hasattr(attn, "head_dim") and names <= {
        "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}


def deployable(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` in eval mode with every plain attention module replaced by
    :class:`SplitQKVAttention`; other attention modules run their ``math`` backend if they have
    one. ``model`` is not modified."""
    m = copy.deepcopy(model).eval().float()
    for blk in getattr(m, "blocks", []):
        if _plain_attention(blk.attn):
            blk.attn = SplitQKVAttention(blk.attn)
        elif hasattr(blk.attn, "set_backend"):
            blk.attn.set_backend("math")
    return m
