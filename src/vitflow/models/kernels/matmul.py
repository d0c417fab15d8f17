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

On the native kernel, :func:`linear_bf16` hands the bias to oneDNN's GEMM (its bias argument)
instead of ``addmm``'s copy of the broadcast bias into the output before the GEMM: one pass less
over each output (5-9% of a ViT-B qkv or fc1 forward measured here), results and gradients equal
to native autocast's bit for bit, except the weight and bias gradients of batches of
:data:`SPLIT_ROWS` rows and more: the weight's is two half-batch products (each rounded to bf16, as
autocast's one product is) summed in fp32, so the rounding error is bf16's of each half's sum
rather than of the total; the bias's is ``ones @ g`` (the same fp32 accumulation and one rounding,
in another summation order).

Every linear layer of a vitflow model is a :class:`Linear` (an ``nn.Linear`` with the same
parameters and state-dict names) whose attribute ``gemm`` holds its mode and whose forward makes
the choice. Modes (``VisionTransformer(cpu_bf16_matmul=...)``, config ``model.cpu_bf16_matmul``): ``bf16``
(always the native kernel), ``fp32`` (always the fp32 GEMM), ``auto`` (the default: on the first
call of each ``(rows, in, out, bias?, input dtype, backward?)`` both run on constant data of that
shape — forward, plus the backward's GEMMs when gradients are on, run without autograd so that a
first call inside a checkpointed block is safe; one warm-up and :data:`TIMED_CALLS` timed calls
each, fastest call — and ``fp32`` is kept only when it is more than :data:`TIE` faster; the
choice is logged, at debug level, and kept in :mod:`vitflow.timing`'s record: in checkpoints, in the
machine's cache, rank 0's under torchrun). Outside bf16 CPU autocast a :class:`Linear` is ``F.linear``.

:class:`Linear` also takes an optional ``residual`` and then returns ``residual + linear(x)`` with
the add inside the GEMM (BLAS ``C = A B + C``) where that is exact and safe: the pre-norm block's
``x + proj(...)`` and ``x + fc2(...)`` without two extra passes over the activation.

Outside autocast, large fp32 products (and the fp32 products of the ``fp32`` mode above) run on
oneDNN's GEMM where :func:`vitflow.models.kernels.onednn.fp32_gemm` found it faster than PyTorch's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow import timing
from vitflow.models.kernels import onednn
from vitflow.timing import fastest, tracing

log = logging.getLogger(__name__)

MODES = ("auto", "bf16", "fp32")
TIMED_CALLS = 3
TIE = 0.05  # fp32 must be faster than the native kernel by more than this to be chosen
# From this many rows the native kernel's weight gradient is two half-batch products summed (oneDNN
# spreads one long-reduction GEMM over 2 threads poorly: Swin-T's stage 1-2 layers, 25-100k rows,
# microbenchmarks 7-50% faster per product, the bf16 training step 2.5% faster in-process A/B) and its
# bias gradient a GEMM with a ones vector (bf16 column sums of 100352 x 384: 13.8 -> 3.5 ms).
SPLIT_ROWS = 20000
KIND = "bf16_matmul"  # its choices in vitflow.timing's record: kept in checkpoints, cached per machine
_CHOICES: dict[tuple, str] = timing.choice_table(KIND)


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`. Raises ValueError naming it otherwise."""
    if mode not in MODES:
        raise ValueError(f"cpu_bf16_matmul must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def set_gemm_mode(model: nn.Module, mode: str) -> str:
    """Give every :class:`Linear` of ``model`` the bf16-autocast GEMM ``mode`` (``auto``, ``bf16``,
    ``fp32``); returns it. Raises ValueError for another mode."""
    check_mode(mode)
    for m in model.modules():
        if isinstance(m, Linear):
            m.gemm = mode
    return mode


def _fp32_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The forward of :func:`linear_fp32_gemm` without autograd: ``(y bf16, x16, w16)``."""
    x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    b32 = None if bias is None else bias.to(torch.bfloat16).float()
    y = onednn.matmul_t(x16.reshape(-1, x16.shape[-1]).float(), w16.float(), b32)
    return y.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0]), x16, w16


def _fp32_backward(grad: torch.Tensor, x16: torch.Tensor, w16: torch.Tensor, needs: tuple[bool, bool, bool],
                   dtypes: tuple) -> tuple:
    """Gradients ``(x, weight, bias)`` of :func:`linear_fp32_gemm` (``None`` where not needed)."""
    x_dtype, w_dtype, b_dtype = dtypes
    g = grad.reshape(-1, grad.shape[-1]).float()
    gx = onednn.matmul_t(g, w16.float().t()).view(x16.shape).to(x_dtype) if needs[0] else None
    gw = (g.t() @ x16.reshape(-1, x16.shape[-1]).float()).to(w_dtype) if needs[1] else None
    gb = g.sum(0).to(b_dtype) if b_dtype is not None and needs[2] else None
    return gx, gw, gb


class _Bf16Linear(torch.autograd.Function):
    """A bf16-autocast linear whose forward and backward are given as a pair: ``(_fp32_forward,
    _fp32_backward)`` computes ``round_bf16(round_bf16(x) @ round_bf16(W)^T + round_bf16(b))`` with
    the GEMMs in fp32 (see the module docstring); ``(_bf16_forward, _bf16_backward)`` is native
    autocast with the bias inside oneDNN's GEMM (instead of ``addmm``'s copy of the broadcast bias
    into the output: one pass less), bit-equal to it (but for long batches' weight and bias gradients,
    see the module docstring). Both run with autocast off and save the bf16 input and weight, as native
    autocast does."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernels):
        forward, ctx.backward_kernel = kernels
        with torch.autocast("cpu", enabled=False):
            y, x16, w16 = forward(x, weight, bias)
        ctx.save_for_backward(x16, w16)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        # the kernels reshape their GEMM's output: detached, it is no view of a tensor made here,
        # which autograd would refuse to let an in-place op (ReLU(inplace=True)) modify; no copy
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            return *ctx.backward_kernel(grad, x16, w16, ctx.needs_input_grad[:3], ctx.dtypes), None


def linear_fp32_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16-autocast ``F.linear`` computed with the fp32 GEMM: ``x (..., K)`` any float dtype,
    ``weight (N, K)``, ``bias (N,)`` -> bf16 ``(..., N)``; differentiable."""
    return _Bf16Linear.apply(x, weight, bias, (_fp32_forward, _fp32_backward))


PLAIN_TENSORS = (torch.Tensor, nn.Parameter)  # not subclasses such as FSDP's DTensor


def _bf16_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The forward of :func:`linear_bf16` without autograd: ``(y bf16, x16, w16)``; the bias (rounded
    to bf16) is added by oneDNN's GEMM where it has bf16 here, else by ``F.linear``."""
    x16, w16 = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    b16 = None if bias is None else bias.to(torch.bfloat16)
    if b16 is not None and onednn.BF16:
        return onednn.PW(x16, w16, b16, "none", [], ""), x16, w16
    return F.linear(x16, w16, b16), x16, w16


def _weight_gradient(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g^T x`` for bf16 ``g (M, N)``, ``x (M, K)``: one GEMM, or for :data:`SPLIT_ROWS` rows and
    more (an even count) the two half-batches' products (one ``bmm``, each rounded to bf16) summed
    in fp32."""
    rows = g.shape[0]
    if rows < SPLIT_ROWS or rows % 2:
        return g.t() @ x
    return torch.bmm(g.view(2, rows // 2, -1).transpose(1, 2), x.view(2, rows // 2, -1)).sum(0, dtype=torch.float32)


def bias_gradient(g: torch.Tensor) -> torch.Tensor:
    """A linear layer's bias gradient, the column sums of its output's gradient ``g (M, N)``, as
    ``(N,)`` in ``g``'s dtype: ``g.sum(0)``, or for bf16 ``g`` of :data:`SPLIT_ROWS` rows and more
    ``ones @ g`` through oneDNN (fp32 accumulation and one rounding to bf16 as ``sum``'s, another
    summation order; 1.4-4x faster there)."""
    if g.shape[0] < SPLIT_ROWS or g.dtype != torch.bfloat16:
        return g.sum(0)
    return (g.new_ones(1, g.shape[0]) @ g).view(-1)


def _bf16_backward(grad: torch.Tensor, x16: torch.Tensor, w16: torch.Tensor, needs: tuple[bool, bool, bool],
                   dtypes: tuple) -> tuple:
    """Gradients ``(x, weight, bias)`` of :func:`linear_bf16`, as native autocast computes them (bf16
    GEMMs, rounded to bf16, widened to each input's dtype; the weight and bias gradients of a long
    batch by :func:`_weight_gradient` and :func:`bias_gradient`); ``None`` where not needed."""
    x_dtype, w_dtype, b_dtype = dtypes
    g = grad.to(torch.bfloat16).reshape(-1, grad.shape[-1])
    gx = (g @ w16).view(x16.shape).to(x_dtype) if needs[0] else None
    gw = _weight_gradient(g, x16.reshape(-1, x16.shape[-1])).to(w_dtype) if needs[1] else None
    gb = bias_gradient(g).to(b_dtype) if b_dtype is not None and needs[2] else None
    return gx, gw, gb


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bf16-autocast ``F.linear`` through oneDNN's bf16 GEMM, bit-equal to native autocast (but for
    long batches' weight and bias gradients, see the module docstring), with
    the bias inside the GEMM where oneDNN has bf16 on this CPU and the tensors are plain (not
    subclasses such as FSDP's DTensor); else ``F.linear``. ``x (..., K)``, ``weight (N, K)``,
    ``bias (N,)`` -> bf16 ``(..., N)``; differentiable."""
    if bias is None or not onednn.BF16 or any(type(t) not in PLAIN_TENSORS for t in (x, weight, bias)):
        return F.linear(x, weight, bias)
    return _Bf16Linear.apply(x, weight, bias, (_bf16_forward, _bf16_backward))


def _bf16_cpu_autocast(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def _choose(key: tuple, layer: nn.Linear) -> str:
    """Time both kernels for ``key``; returns the choice. The backward's GEMMs are run
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
            _, x16, w16 = _bf16_forward(x, w, b)
            if backward:
                _bf16_backward(g, x16, w16, (True, True, has_bias), dtypes)

        def fp32() -> None:
            _, x16, w16 = _fp32_forward(x, w, b)
            if backward:
                _fp32_backward(g, x16, w16, (True, True, has_bias), dtypes)

        best = fastest({"bf16": native, "fp32": fp32}, TIMED_CALLS)
    choice = "fp32" if best["fp32"] < best["bf16"] * (1 - TIE) else "bf16"
    log.debug("cpu_bf16_matmul=auto: %s GEMM for (%d x %d) @ (%d x %d)^T, %s (ms: bf16 %.2f, fp32 %.2f)", choice, rows,
             k, k, n, "fwd+bwd" if backward else "fwd", best["bf16"] * 1e3, best["fp32"] * 1e3)
    return choice


def _gemm_choice(layer: nn.Linear, x: torch.Tensor) -> str:
    """``auto``'s choice for ``layer`` on ``x``: the recorded one for this shape (this process's, a
    resumed run's, the machine's cache's: :func:`vitflow.timing.choose`), timed on first sight."""
    backward = torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad)
    key = (x.numel() // x.shape[-1], layer.in_features, layer.out_features, layer.bias is not None, x.dtype, backward)
    return _CHOICES.get(key) or timing.choose(KIND, key, lambda: _choose(key, layer))


class Linear(nn.Linear):
    """``nn.Linear`` with the same parameters and state-dict names (timm's checkpoints load as
    they are) and three additions that leave the result unchanged up to rounding (see the module
    docstring):

    - under bf16 CPU autocast, the GEMM that ``gemm`` (``auto`` | ``bf16`` | ``fp32``) selects;
    - in fp32 on the CPU, oneDNN's GEMM for large products where it outruns PyTorch's
      (:mod:`vitflow.models.kernels.onednn`; equal up to summation order);
    - ``forward(x, residual, detach_bias)``: with ``detach_bias`` no gradient reaches the bias
      (a caller that computes it itself, e.g. the fused window attention); with ``residual``
      returns ``residual + linear(x)``, the add inside the GEMM
      (oneDNN's, or ``(residual + bias).addmm_(x, W^T)``) for fp32/fp64 eager calls; anywhere
      else (autocast, tracing for export or compile, no bias, mixed dtypes, tensor subclasses such
      as FSDP's DTensor) as an ordinary add.

    Shapes: ``x (..., in_features)``, ``residual (..., out_features)`` with the same leading
    dimensions -> ``(..., out_features)``.

    Raises:
        ValueError: an unknown ``gemm`` mode.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gemm: str = "auto", **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.gemm = check_mode(gemm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, detach_bias: bool = False) -> torch.Tensor:
        bias = self.bias.detach() if detach_bias and self.bias is not None else self.bias
        if _bf16_cpu_autocast(x) and not tracing():
            fp32 = self.gemm == "fp32" or (self.gemm == "auto" and _gemm_choice(self, x) == "fp32")
            y = (linear_fp32_gemm if fp32 else linear_bf16)(x, self.weight, bias)
        elif self._onednn(x, residual):
            return onednn.linear_onednn(x, self.weight, bias, residual)
        elif residual is not None and self._fusable(x, residual):
            out = torch.add(residual.reshape(-1, residual.shape[-1]), bias)
            return out.addmm_(x.reshape(-1, x.shape[-1]), self.weight.t()).view(residual.shape)
        else:
            y = F.linear(x, self.weight, bias)
        return y if residual is None else residual + y

    def _onednn(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether this call goes to :func:`linear_onednn`: fp32 eager CPU, large, plain tensors, no
        ``torch.func`` transform (the function has no ``setup_context``). Tracing is checked first:
        reading ``x``'s shape there would pin a dynamic batch size."""
        w, b, f32 = self.weight, self.bias, torch.float32
        return (not tracing() and not torch._C._are_functorch_transforms_active() and x.device.type == "cpu"
                and x.dtype == w.dtype == f32 and (b is None or b.dtype == f32)
                and type(x) is torch.Tensor and type(w) in PLAIN_TENSORS and not torch.is_autocast_enabled("cpu")
                and (residual is None or type(residual) is torch.Tensor and residual.dtype == f32
                     and residual.shape == (*x.shape[:-1], w.shape[0]))
                and onednn.large(x.numel() // x.shape[-1], x.shape[-1], w.shape[0]))

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        w, b = self.weight, self.bias
        return (b is not None and not tracing() and not torch.is_autocast_enabled(x.device.type)
                and residual.dtype == x.dtype == w.dtype == b.dtype and residual.shape[:-1] == x.shape[:-1]
                and type(w) is nn.Parameter and type(residual) is torch.Tensor)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.gemm == "auto" else f", gemm={self.gemm}")


def as_plain_linear(model: nn.Module) -> nn.Module:
    """Replace every :class:`Linear` of ``model`` (in place) by an ``nn.Linear`` holding the same
    parameters, for tools that match ``nn.Linear`` by exact type (PyTorch's dynamic
    quantization). Returns ``model``."""
    for name, child in model.named_children():
        if type(child) is Linear:
            plain = nn.Linear(child.in_features, child.out_features, child.bias is not None,
                              device=child.weight.device, dtype=child.weight.dtype)
            plain.weight, plain.bias = child.weight, child.bias
            setattr(model, name, plain)
        else:
            as_plain_linear(child)
    return model


def clear_choices() -> None:
    """Forget the timed choices, a resumed run's too (the next call of each shape takes the machine's
    cache's or times both kernels again)."""
    timing.forget(KIND)
