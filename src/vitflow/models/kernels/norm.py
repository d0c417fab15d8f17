"""A pre-norm block's residual add and the LayerNorm after it in one pass (``add_layer_norm.cpp``),
for bf16 autocast on the CPU, forward and backward.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a pre-norm block (:class:`~vitflow.models.block.Block`)
keeps its residual stream in float32: each branch's bf16 output is added to it (one pass), the
LayerNorm runs in float32 (another) and the next linear layer rounds its output to bf16 (a third);
the backward mirrors them. :func:`add_layer_norm` does the three in one pass over each row, and its
backward (:class:`_AddLayerNormFn`) the LayerNorm's input gradient, the sum with the gradient that
reaches the residual stream from its other uses, and the branch's bf16 rounding in another, with
the weight and bias gradients summed per thread. The results are PyTorch's up to the order of the
float32 sums: the sum ``x + branch`` is bit for bit, the bf16 LayerNorm output differs from PyTorch's
float32 LayerNorm rounded to bf16 by one bf16 rounding step on a few elements in ten thousand.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitflow.models.kernels import cpp
from vitflow.models.kernels.matmul import PLAIN_TENSORS
from vitflow.timing import tracing


def fusable(x: torch.Tensor, *norms: nn.Module) -> bool:
    """Whether :func:`add_layer_norm` may replace ``norms``' forwards on ``x``: bf16 CPU autocast, a
    plain contiguous float32 ``x``, no tracing (export, compile) or ``torch.func`` transform, each
    norm an ``nn.LayerNorm`` over the last dimension with plain float32 affine parameters (not
    tensor subclasses such as FSDP's DTensor) and no hooks, and vitflow's CPU kernels available
    (:func:`vitflow.models.kernels.cpp.available`; a block builds them at construction)."""
    if type(x) is not torch.Tensor or x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return False
    if tracing() or torch._C._are_functorch_transforms_active():
        return False
    for n in norms:
        if not (isinstance(n, nn.LayerNorm) and len(n.normalized_shape) == 1 and type(n.weight) in PLAIN_TENSORS
                and type(n.bias) in PLAIN_TENSORS and n.weight.dtype == n.bias.dtype == torch.float32
                and not (n._forward_hooks or n._forward_pre_hooks)):
            return False
    return x.is_contiguous() and cpp.available()


class _AddLayerNormFn(torch.autograd.Function):
    """``(s, y)`` of :func:`add_layer_norm` with a branch, ``y`` alone without one; the backward
    takes both gradients (``s`` feeds the next residual add) in one kernel call."""

    @staticmethod
    def forward(ctx, x, branch, weight, bias, eps: float):
        empty = x.new_empty(0)
        s, y, mean, rstd = cpp.ops().add_layer_norm(x, empty if branch is None else branch, weight, bias, eps)
        ctx.save_for_backward(s, mean, rstd, weight)
        ctx.branch_dtype = None if branch is None else branch.dtype
        return y if branch is None else (s, y)

    @staticmethod
    def backward(ctx, *grads):
        s, mean, rstd, weight = ctx.saved_tensors
        gs, gy = (None, grads[0]) if ctx.branch_dtype is None else grads
        gy = torch.zeros_like(s) if gy is None else gy.contiguous()
        gs = s.new_empty(0) if gs is None else gs.float().contiguous()
        bf16 = ctx.branch_dtype == torch.bfloat16
        gx, gb, dw, db = cpp.ops().add_layer_norm_backward(gy, gs, s, mean, rstd, weight, bf16)
        gbranch = None if ctx.branch_dtype is None else gb if bf16 else gx.to(ctx.branch_dtype, copy=True)
        return gx, gbranch, dw, db, None


def add_layer_norm(x: torch.Tensor, branch: torch.Tensor | None,
                   norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s) as bf16)`` with ``s = x + branch`` in float32 (``x`` itself when ``branch`` is
    ``None``); differentiable in ``x``, ``branch`` and the norm's parameters. ``x (..., C)`` float32
    contiguous, ``branch`` of its shape (float32 or bfloat16); check :func:`fusable` first.

    Raises:
        RuntimeError: shapes, dtypes or layout outside the above (the kernel's checks).
    """
    if branch is None:
        return x, _AddLayerNormFn.apply(x, None, norm.weight, norm.bias, norm.eps)
    return _AddLayerNormFn.apply(x, branch.contiguous(), norm.weight, norm.bias, norm.eps)
