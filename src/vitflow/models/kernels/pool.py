"""MViTv2's conv pooling of q, k and v by vitflow's C++ CPU kernel (``csrc/pool_qkv.cpp``).

PyTorch's depthwise convolution on the head-major layout (timm's: each of q, k, v copied to
``(B*heads, d, H, W)`` before its ``Conv2d``, and back) spends most of an MViT training step's
non-GEMM time in layout copies, the convolution's backward and the zero-filled gradient of each
third of the qkv projection. :func:`pool_qkv` reads the packed projection in its token layout,
pools each third with its depthwise kernel (shared by the heads, padding ``k // 2``) and writes
head-major ``(B, heads, P + h*w, d)``; its backward writes the whole qkv gradient once (each input
pixel gathers from the outputs that read it) and sums the kernels' gradients along output rows in
registers. Measured on MViTv2-T (``benchmarks/models/models.py --models mvit``) and on the plan's
MViTv2 against its ViT (``benchmarks/models/train_flops.py``; see the benchmarks guide). Where the kernels are unavailable, or the call does not
fit them (tracing for export or compile, CUDA, other dtypes, non-square kernels), the caller
runs PyTorch's convolution (:func:`vitflow.models.mvit.pooling.pool_tokens`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitflow.models.kernels import cpp
from vitflow.timing import tracing


def _flat(conv: nn.Conv2d) -> torch.Tensor:
    """A depthwise kernel ``(d, 1, k, k)`` as float32 ``(d, k*k)`` (its own storage when float32)."""
    return conv.weight.reshape(conv.weight.shape[0], -1).float().contiguous()


class _PoolQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, wq, wk, wv, geometry):
        ctx.save_for_backward(qkv, wq, wk, wv)
        ctx.geometry = geometry
        return tuple(cpp.ops().pool_qkv_forward(qkv, wq, wk, wv, *geometry))

    @staticmethod
    def backward(ctx, gq, gk, gv):
        qkv, wq, wk, wv = ctx.saved_tensors
        grads = [g.to(qkv.dtype).contiguous() for g in (gq, gk, gv)]
        dqkv, dwq, dwk, dwv = cpp.ops().pool_qkv_backward(*grads, qkv, wq, wk, wv, *ctx.geometry)
        return dqkv, dwq, dwk, dwv, None


def fits(qkv: torch.Tensor, convs: tuple[nn.Conv2d | None, ...]) -> bool:
    """Whether :func:`pool_qkv` runs this call: vitflow's kernels built, a float32 / bfloat16 CPU
    tensor, not tracing, three square depthwise kernels of one size with square strides and
    padding ``k // 2``."""
    if any(c is None for c in convs) or qkv.device.type != "cpu" or tracing():
        return False
    if qkv.dtype not in (torch.float32, torch.bfloat16) or type(qkv) is not torch.Tensor:
        return False
    k = convs[0].kernel_size[0]
    return (all(c.kernel_size == (k, k) and c.stride[0] == c.stride[1] and c.padding == (k // 2, k // 2)
                and c.weight.dtype == torch.float32 for c in convs) and cpp.available())


def pool_qkv(qkv: torch.Tensor, convs: tuple[nn.Conv2d, nn.Conv2d, nn.Conv2d], grid: tuple[int, int], prefix: int,
             heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise-conv pooling of q, k and v from the packed projection.

    Args:
        qkv: ``(B, prefix + H*W, 3*heads*d)`` float32 or bfloat16 (CPU), tokens row-major.
        convs: the three depthwise ``Conv2d(d, d, k, s, k // 2, groups=d)`` (their weights, float32).
        grid: ``(H, W)``. prefix: class tokens (copied). heads: attention heads.
    Returns:
        q ``(B, heads, prefix + hq*wq, d)``, k and v ``(B, heads, prefix + hk*wk, d)``, contiguous, in
        ``qkv``'s dtype (float32 arithmetic); differentiable in ``qkv`` and the three kernels.
    Raises:
        RuntimeError: the kernels are unavailable (check :func:`fits` first).
    """
    geometry = (prefix, grid[0], grid[1], heads, convs[0].kernel_size[0], convs[0].stride[0], convs[1].stride[0])
    weights = [_flat(c) for c in convs]
    if torch.is_grad_enabled() and (qkv.requires_grad or any(c.weight.requires_grad for c in convs)):
        q, k, v = _PoolQKV.apply(qkv.contiguous(), *weights, geometry)
        return q, k, v
    return tuple(cpp.ops().pool_qkv_forward(qkv.contiguous(), *weights, *geometry))
