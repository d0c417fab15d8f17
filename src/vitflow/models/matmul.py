"""bf16 linear layers on the CPU: oneDNN's bf16 GEMM, or the same products in the fp32 GEMM.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a linear layer rounds its input and weight
to bf16 and multiplies them with oneDNN's bf16 GEMM (fp32 accumulation, bf16 output). Where
that kernel is slow — CPUs without AMX, and some virtual machines, where it runs below the fp32
GEMM (measured on the project's machine: matmul peak bf16 156 GFLOP/s, fp32 270-290; a ViT
linear's forward + backward 1.3-2.9x faster through fp32) — :func:`linear` multiplies the same
bf16-rounded operands with the fp32 GEMM instead. A product of two bf16 numbers is exact in fp32
and both kernels accumulate in fp32, so the result is the native one up to summation order; it
is then rounded to bf16 as before. The input, the output and what the backward keeps stay bf16
(the memory of bf16 autocast); only the GEMM operands are widened, for the call. Gradients: the
input's is rounded to the input's dtype, the weight's and bias's are fp32 (native autocast
rounds the weight gradient to bf16 first).

Modes (``VisionTransformer(cpu_bf16_matmul=...)``, config ``model.cpu_bf16_matmul``): ``bf16``
(always the native kernel), ``fp32`` (always the fp32 GEMM), ``auto`` (the default: on the first
call of each ``(rows, in, out, bias?, input dtype, backward?)`` both run on constant data of that
shape — forward, plus the backward's GEMMs when gradients are on, run without autograd so that a
first call inside a checkpointed block is safe; one warm-up and :data:`TIMED_CALLS` timed calls
each, fastest call — and ``fp32`` is kept only when it is more than :data:`TIE` faster; the
choice is logged). Outside bf16 CPU autocast, or for a module that is not a plain
``nn.Linear`` (e.g. dynamically quantized), :func:`linear` is ``layer(x)``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.timing import fastest, tracing

log = logging.getLogger(__name__)

MODES = ("auto", "bf16", "fp32")
TIMED_CALLS = 3
TIE = 0.05  # fp32 must be faster than the native kernel by more than this to be chosen
_CHOICES: dict[tuple, str] = {}


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`. Raises ValueError naming it otherwise."""
    if mode not in MODES:
        raise ValueError(f"cpu_bf16_matmul must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _fp32_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The forward of :func:`linear_fp32_gemm` without autograd: ``(y bf16, x16, w16)``."""
    x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    x2 = x16.reshape(-1, x16.shape[-1]).float()
    w32 = w16.float().t()
    y = torch.addmm(bias.to(torch.bfloat16).float(), x2, w32) if bias is not None else x2 @ w32
    return y.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0]), x16, w16


def _fp32_backward(grad: torch.Tensor, x16: torch.Tensor, w16: torch.Tensor, needs: tuple[bool, bool, bool],
                   dtypes: tuple) -> tuple:
    """Gradients ``(x, weight, bias)`` of :func:`linear_fp32_gemm` (``None`` where not needed)."""
    x_dtype, w_dtype, b_dtype = dtypes
    g = grad.reshape(-1, grad.shape[-1]).float()
    gx = (g @ w16.float()).view(x16.shape).to(x_dtype) if needs[0] else None
    gw = (g.t() @ x16.reshape(-1, x16.shape[-1]).float()).to(w_dtype) if needs[1] else None
    gb = g.sum(0).to(b_dtype) if b_dtype is not None and needs[2] else None
    return gx, gw, gb


class _Fp32GemmLinear(torch.autograd.Function):
    """``y = round_bf16(round_bf16(x) @ round_bf16(W)^T + round_bf16(b))`` with the GEMMs in fp32
    (see the module docstring). Saves the bf16 input and weight, as native autocast does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        with torch.autocast("cpu", enabled=False):
            y, x16, w16 = _fp32_forward(x, weight, bias)
        ctx.save_for_backward(x16, w16)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            return _fp32_backward(grad, x16, w16, ctx.needs_input_grad, ctx.dtypes)


def linear_fp32_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16-autocast ``F.linear`` computed with the fp32 GEMM: ``x (..., K)`` any float dtype,
    ``weight (N, K)``, ``bias (N,)`` -> bf16 ``(..., N)``; differentiable."""
    return _Fp32GemmLinear.apply(x, weight, bias)


def _bf16_cpu_autocast(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _choose(key: tuple, layer: nn.Linear) -> str:
    """Time both kernels for ``key`` and record the choice. The backward's GEMMs are run
    explicitly without autograd: the first call may sit inside a checkpointed region, whose
    saved-tensor bookkeeping must not see the timing."""
    rows, k, n, has_bias, dtype, backward = key
    bf16 = torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x = torch.full((rows, k), 0.5, dtype=dtype)  # constant: no RNG, same speed
        w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
        g = torch.full((rows, n), 0.25, dtype=bf16)
        dtypes = (dtype, w.dtype, None if b is None else b.dtype)

        def native() -> None:  # what autocast runs: bf16 operands, oneDNN's bf16 GEMMs
            x16, w16 = x.to(bf16), w.to(bf16)
            F.linear(x16, w16, None if b is None else b.to(bf16))
            if backward:
                _ = (g @ w16).to(dtype), (g.t() @ x16).to(w.dtype), g.sum(0) if has_bias else None

        def fp32() -> None:
            _, x16, w16 = _fp32_forward(x, w, b)
            if backward:
                _fp32_backward(g, x16, w16, (True, True, has_bias), dtypes)

        best = fastest({"bf16": native, "fp32": fp32}, TIMED_CALLS)
    choice = "fp32" if best["fp32"] < best["bf16"] * (1 - TIE) else "bf16"
    log.debug("cpu_bf16_matmul=auto: %s GEMM for (%d x %d) @ (%d x %d)^T, %s (ms: bf16 %.2f, fp32 %.2f)", choice, rows,
             k, k, n, "fwd+bwd" if backward else "fwd", best["bf16"] * 1e3, best["fp32"] * 1e3)
    _CHOICES[key] = choice
    return choice


def linear(layer: nn.Module, x: torch.Tensor, mode: str = "auto") -> torch.Tensor:
    """``layer(x)``; under bf16 CPU autocast a plain ``nn.Linear`` runs the GEMM that ``mode``
    selects (see the module docstring). ``x (..., in_features)`` -> ``(..., out_features)``."""
    if mode == "bf16" or type(layer) is not nn.Linear or not _bf16_cpu_autocast(x) or tracing():
        return layer(x)
    if mode == "auto":
        backward = torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)
        key = (x.numel() // x.shape[-1], layer.in_features, layer.out_features, layer.bias is not None, x.dtype,
               backward)
        mode = _CHOICES.get(key) or _choose(key, layer)
    return linear_fp32_gemm(x, layer.weight, layer.bias) if mode == "fp32" else layer(x)


def linear_residual(residual: torch.Tensor, layer: nn.Module, x: torch.Tensor, mode: str = "auto") -> torch.Tensor:
    """``residual + layer(x)``, for a plain ``nn.Linear`` with bias outside autocast, with the
    residual add inside the GEMM: ``(residual + bias).addmm_(x, W^T)`` (BLAS ``C = A B + C``).

    The unfused form writes the bias into a new output (``addmm``'s broadcast copy), runs the
    GEMM into it and adds the residual in a third tensor; this one makes one pass for
    ``residual + bias`` and lets the GEMM accumulate onto it — two fewer passes over the
    ``(tokens, out_features)`` activation and one allocation fewer. Autograd is unaffected (the
    in-place GEMM writes a temporary that nothing saved). Anywhere else (autocast, no bias,
    another module type or one with forward hooks, compile / export tracing, mixed dtypes) it is
    ``residual + linear(layer, x, mode)``.

    Shapes: ``residual (..., out_features)``, ``x (..., in_features)`` with the same leading
    dimensions -> ``(..., out_features)`` in their dtype.
    """
    w, b = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if (type(layer) is not nn.Linear or b is None or tracing() or torch.is_autocast_enabled(x.device.type)
            or not residual.dtype == x.dtype == w.dtype == b.dtype or residual.shape[:-1] != x.shape[:-1]
            or type(w) is not nn.Parameter or type(residual) is not torch.Tensor
            or layer._forward_hooks or layer._forward_pre_hooks):
        return residual + linear(layer, x, mode)
    out = torch.add(residual.reshape(-1, residual.shape[-1]), b)
    out.addmm_(x.reshape(-1, x.shape[-1]), w.t())
    return out.view(residual.shape)


def clear_choices() -> None:
    """Forget the timed choices (the next call of each shape times both kernels again)."""
    _CHOICES.clear()
