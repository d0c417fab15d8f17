"""Attention backends: the one place where the attention math lives.

A backend is an :class:`AttentionKernel` module: ``kernel(qkv, num_heads, ctx)`` maps the
packed qkv projection ``(B, N, 3*H*d)`` to merged heads ``(B, N, H*d)`` (see :mod:`.core`). Backends,
chosen by ``model.attention``:

========== ====================================================================== ===========
name       what                                                                    memory
========== ====================================================================== ===========
sdpa       ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels)   O(N) GPU
math       explicit softmax(Q K^T / sqrt(d)) V, fused copies, custom backward      O(N^2)
blockwise  exact, key blocks with an online softmax (Rabe & Staats 2021)           O(N*block)
local      window of radius r on the patch grid + class token (FlexAttention/SDPA) O(N^2)/sparse
axial      row and column on the patch grid + class token                          O(N^2)/sparse
linformer  keys/values projected to k along the sequence (Wang et al. 2020)        O(N*k)
performer  FAVOR+ positive orthogonal random features (Choromanski et al. 2021)    O(N*m)
auto       times sdpa, math, blockwise on the first batch's shape; keeps the best  -
========== ====================================================================== ===========

``sdpa``, ``math``, ``blockwise`` and ``auto`` are exact (they agree to float rounding), as are
``local`` / ``axial`` when the pattern covers the whole grid.
"""

from __future__ import annotations

from vitflow.models.attention.auto import AutoKernel, clear_choices
from vitflow.models.attention.blockwise import BlockwiseKernel, blockwise_attention
from vitflow.models.attention.core import (
    AttentionContext,
    AttentionKernel,
    MathKernel,
    SdpaKernel,
    attention_probs,
    math_attention,
    merge_heads,
    packed_math_attention,
    sdpa_attention,
    split_heads,
)
from vitflow.models.attention.linear import LinformerKernel, PerformerKernel
from vitflow.models.attention.sparse import SparseKernel, grid_mask

BACKENDS = ("sdpa", "math", "blockwise", "local", "axial", "linformer", "performer", "auto")
EXACT_BACKENDS = ("sdpa", "math", "blockwise")  # the candidates of ``auto``


def make_kernel(name: str, *, seq_len: int, head_dim: int, block_size: int = 128, window: int = 3,
                linformer_k: int | None = None, performer_features: int | None = None) -> AttentionKernel:
    """Build the backend ``name``.

    Args:
        seq_len: tokens per image at the model's native size (Linformer's projection width).
        head_dim: channels per head (Performer's features).
        block_size: ``blockwise`` key-block size.
        window: ``local`` window radius in patches.
        linformer_k: Linformer's projected length (default ``seq_len // 4``).
        performer_features: Performer's random features (default ``round(d ln d)``).
    Raises:
        ValueError: unknown name (the message lists the backends) or a bad option.
    """
    if name == "sdpa":
        return SdpaKernel()
    if name == "math":
        return MathKernel()
    if name == "blockwise":
        return BlockwiseKernel(block_size)
    if name in ("local", "axial"):
        return SparseKernel(name, window)
    if name == "linformer":
        return LinformerKernel(seq_len, linformer_k)
    if name == "performer":
        return PerformerKernel(head_dim, performer_features)
    if name == "auto":
        return AutoKernel({n: make_kernel(n, seq_len=seq_len, head_dim=head_dim, block_size=block_size)
                           for n in EXACT_BACKENDS})
    if name == "fused":
        raise ValueError("model.attention='fused' is Swin's window-attention kernel; this model takes one of "
                         f"{', '.join(BACKENDS)}")
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = [
    "AttentionContext", "AttentionKernel", "AutoKernel", "BACKENDS", "BlockwiseKernel", "EXACT_BACKENDS",
    "LinformerKernel", "MathKernel", "PerformerKernel", "SdpaKernel", "SparseKernel", "attention_probs",
    "blockwise_attention", "clear_choices", "grid_mask", "make_kernel", "math_attention", "merge_heads",
    "packed_math_attention", "sdpa_attention", "split_heads",
]
