"""Attention backends: the one place where the attention math lives.

Every backend takes ``q, k, v`` of shape ``(B, H, N, head_dim)`` (any float dtype, all three
the same) and returns ``(B, H, N, head_dim)`` in the same dtype. ``dropout_p`` is the
attention-probability dropout used only in training.

Backends
- ``sdpa``: :func:`torch.nn.functional.scaled_dot_product_attention` (FlashAttention /
  memory-efficient kernels on GPU, the fused flash kernel on CPU).
- ``math``: explicit ``softmax(Q K^T / sqrt(d)) V`` (Vaswani et al. 2017). On this project's
  reference CPU it trains a 65-token ViT ~2x faster than ``sdpa`` in bf16, because the CPU
  flash backward is slow at short sequences (see ``shared/reference/cpu-baselines.md``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Fused scaled dot-product attention through ``F.scaled_dot_product_attention``.

    Shapes: q, k, v ``(B, H, N, d)`` -> ``(B, H, N, d)``; dtype preserved.
    """
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``softmax(Q K^T / sqrt(d))``.

    Shapes: q ``(B, H, N, d)``, k ``(B, H, M, d)`` -> ``(B, H, N, M)``; rows sum to 1.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ((q * scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Explicit attention ``softmax(Q K^T / sqrt(d)) V`` (Vaswani et al. 2017, eq. 1).

    Shapes: q, k, v ``(B, H, N, d)`` -> ``(B, H, N, d)``; dtype preserved.
    """
    attn = attention_probs(q, k)
    if dropout_p > 0.0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v


BACKENDS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "math": math_attention,
}


def get_backend(name: str) -> AttentionFn:
    """Return the attention function registered as ``name``.

    Raises:
        ValueError: ``name`` is not a registered backend (the message lists the valid ones).
    """
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}") from None
