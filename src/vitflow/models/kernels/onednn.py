"""oneDNN's GEMM for the fp32 linear layers on the CPU, where it outruns PyTorch's.

PyTorch multiplies fp32 matrices on the CPU with its BLAS (MKL in the official wheels). On the
project's machine (AMD EPYC, AVX-512) oneDNN's fp32 GEMM — the one PyTorch ships for its fused
``mkldnn::_linear_pointwise`` op — runs a ViT's linear layers 1.1-1.6x faster: ViT-B at 3136 rows,
fc1 forward 89 ms against ``F.linear``'s 111, qkv 57 against 84; the CIFAR ViT's qkv (4160 x 192)
@ (192 x 576)^T 5.8 ms against 7.2; the input gradient alike; below ~8M multiply-adds its per-call
overhead loses (0.04 ms against 0.015 on a 32 x 32 x 96 product). For the weight gradient PyTorch's
GEMM is the faster of the two for most ViT shapes and stays.

:func:`fp32_gemm` decides once per process (``auto``: timed on a ViT-B MLP product, oneDNN kept only
when clearly faster; the environment variable ``VITFLOW_FP32_GEMM`` or :func:`set_fp32_gemm` forces
``onednn`` or ``torch``: ``auto``'s timing may choose differently in two processes on a busy machine,
so two separate runs of one config round alike only with a forced GEMM; a resumed run always takes
its checkpoint's). :func:`linear_onednn` is
the fp32 linear on oneDNN (bias and an optional residual added inside its GEMM) and
:func:`matmul_t` the fp32 product used by bf16 linear layers that multiply in fp32
(:mod:`vitflow.models.kernels.matmul`). Results equal PyTorch's up to summation order (fp32 rounding, ~1e-7
relative to the output's scale; tested against float64).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from vitflow import timing
from vitflow.runtime import cpu_bf16_supported
from vitflow.timing import fastest

log = logging.getLogger(__name__)

AVAILABLE = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()
PW = torch.ops.mkldnn._linear_pointwise if AVAILABLE else None  # (x, W, b, "none", [], "") -> x W^T + b

BF16 = AVAILABLE and cpu_bf16_supported()  # oneDNN's bf16 GEMM here (bf16 linear layers hand it their bias, vitflow.models.kernels.matmul)
FP32_GEMMS = ("auto", "onednn", "torch")
MIN_MACS = 1 << 23  # below this many multiply-adds per product oneDNN's per-call overhead outweighs its kernel
TIMED_CALLS = 3
TIE = 0.1  # oneDNN must be faster than PyTorch's GEMM by more than this to be chosen
ENV_VAR = "VITFLOW_FP32_GEMM"  # the process's default mode (auto where unset); set_fp32_gemm overrides it
_STATE: dict[str, str | None] = {"mode": None, "choice": ""}  # mode None: ENV_VAR's
KIND, PROBE = "fp32_gemm", "(1024 x 768) @ (768 x 3072)"  # auto's choice in vitflow.timing's record


def set_fp32_gemm(mode: str) -> str:
    """Choose the GEMM of large fp32 linear layers on the CPU for this process: ``onednn``, ``torch``
    (PyTorch's ``addmm``) or ``auto`` (timed once, see :func:`fp32_gemm`); returns ``mode``.

    Raises:
        ValueError: another mode (the message names it).
    """
    if mode not in FP32_GEMMS:
        raise ValueError(f"fp32 GEMM must be one of {', '.join(FP32_GEMMS)}, got {mode!r}")
    _STATE.update(mode=mode, choice="" if mode == "auto" or not AVAILABLE else mode)
    return mode


@contextlib.contextmanager
def forced(mode: str) -> Iterator[None]:
    """:func:`set_fp32_gemm` ``mode`` inside the block, the previous setting (and ``auto``'s timed
    choice) after it."""
    saved = dict(_STATE)
    set_fp32_gemm(mode)
    try:
        yield
    finally:
        _STATE.update(saved)


@contextlib.contextmanager
def run_gemm(saved: str | None) -> Iterator[None]:
    """Inside the block, a checkpoint's fp32 GEMM ``saved`` (its ``fp32_gemm``: ``onednn`` or
    ``torch``), so that evaluating a run's weights rounds as the run's own evaluation did — unless
    this process's mode was set (:func:`set_fp32_gemm` or :data:`ENV_VAR`, which win) or ``saved``
    is ``None`` (a checkpoint from before the choice was saved)."""
    if saved in ("onednn", "torch") and not _requested():
        with forced(saved):
            yield
    else:
        yield


def fp32_gemm() -> str:
    """``onednn`` or ``torch``: the GEMM of large fp32 linear layers on this CPU (``torch`` where
    PyTorch lacks oneDNN). The mode is :func:`set_fp32_gemm`'s, else :data:`ENV_VAR`'s, else ``auto``:
    timed on the first call: (1024 x 768) @ (768 x 3072), forward plus input gradient, on constant
    data, one warm-up and :data:`TIMED_CALLS` calls each, fastest call; oneDNN is kept only when more
    than :data:`TIE` faster (or the machine's cached choice, :func:`vitflow.timing.choose`); the choice
    (or :data:`ENV_VAR`'s) is logged at debug level (``vitflow -v``).

    Raises:
        ValueError: :data:`ENV_VAR` holds another value (see :func:`fp32_mode`).
    """
    if not _STATE["choice"]:
        chosen = fp32_mode()
        if AVAILABLE and chosen != "auto" and not _STATE["mode"]:
            log.debug("fp32 linear layers: %s GEMM (%s)", chosen, ENV_VAR)
        _STATE["choice"] = ("torch" if not AVAILABLE else timing.choose(KIND, PROBE, _time_gemms) if chosen == "auto"
                            else chosen)
    return _STATE["choice"]


def fp32_mode() -> str:
    """This process's fp32 GEMM mode: :func:`set_fp32_gemm`'s, else :data:`ENV_VAR`'s (case
    insensitive; unset or empty: ``auto``). Training calls it at start, so that a bad value fails
    before anything is written.

    Raises:
        ValueError: :data:`ENV_VAR` holds another value (the message names it).
    """
    value = _requested() or "auto"
    if value not in FP32_GEMMS:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(FP32_GEMMS)}, got {os.environ[ENV_VAR]!r}")
    return value


def _requested() -> str:
    """The mode this process asked for: :func:`set_fp32_gemm`'s, else :data:`ENV_VAR`'s (lower
    case), ``""`` when neither (not validated)."""
    return _STATE["mode"] or os.environ.get(ENV_VAR, "").strip().lower()


def decided() -> str | None:
    """The fp32 GEMM chosen or forced so far in this process (``onednn`` | ``torch``), ``None`` while
    ``auto`` has not timed yet (no large fp32 product has run). Saved with training checkpoints; a
    resumed run forces it (:func:`set_fp32_gemm`) and rounds as its first steps did."""
    return _STATE["choice"] or None


def _time_gemms() -> str:
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x, w = torch.full((1024, 768), 0.5), torch.full((3072, 768), 0.25)
        b, g = torch.zeros(3072), torch.full((1024, 3072), 0.125)
        best = fastest({"torch": lambda: (F.linear(x, w, b), g @ w),
                        "onednn": lambda: (PW(x, w, b, "none", [], ""), PW(g, w.t(), None, "none", [], ""))},
                       TIMED_CALLS)
    choice = "onednn" if best["onednn"] < best["torch"] * (1 - TIE) else "torch"
    log.debug("fp32 linear layers: %s GEMM (ms for (1024 x 768) @ (768 x 3072), forward + input gradient: "
              "torch %.2f, oneDNN %.2f)", choice, best["torch"] * 1e3, best["onednn"] * 1e3)
    return choice


def large(rows: int, k: int, n: int) -> bool:
    """Whether a ``(rows, k) @ (k, n)`` product goes to oneDNN: :func:`fp32_gemm` chose it, the
    product has at least :data:`MIN_MACS` multiply-adds and ``torch.backends.mkldnn.enabled``."""
    return rows * k * n >= MIN_MACS and torch.backends.mkldnn.enabled and fp32_gemm() == "onednn"


def matmul_t(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``a (M, K) @ w (N, K)^T (+ bias (N,))`` -> ``(M, N)``: oneDNN's GEMM where :func:`large`,
    else PyTorch's (not differentiable through oneDNN: for use inside autograd functions)."""
    if large(a.shape[0], a.shape[1], w.shape[0]):
        return PW(a, w, bias, "none", [], "")
    return torch.addmm(bias, a, w.t()) if bias is not None else a @ w.t()


class _Linear(torch.autograd.Function):
    """``y = x W^T + b (+ residual)`` on 2-D ``x``, with oneDNN's fp32 GEMM for the forward (bias and
    residual added inside it) and the input gradient, PyTorch's for the weight gradient. Saves
    ``x`` (for W's gradient) and ``W`` (for x's) only where wanted, as ``addmm``'s backward does.
    (2-D only: oneDNN returns an N-D input's output as a view, and a view made inside a custom
    function may not be modified in place.)"""

    @staticmethod
    def forward(ctx, x, weight, bias, residual):
        needs_x, needs_w = ctx.needs_input_grad[:2]  # keep only what the wanted gradients read (frozen W: no x)
        ctx.save_for_backward(x if needs_w else None, weight if needs_x else None)
        ctx.has_bias = bias is not None
        if residual is None:
            return PW(x, weight, bias, "none", [], "")
        return PW.binary(x, residual, weight, bias, "add")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        gx = PW(grad, weight.t(), None, "none", [], "") if needs[0] else None
        gw = grad.t() @ x if needs[1] else None
        gb = grad.sum(0) if ctx.has_bias and needs[2] else None
        return gx, gw, gb, grad if needs[3] else None


def linear_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``F.linear(x, weight, bias) (+ residual)`` through oneDNN's GEMM (forward and input
    gradient; the weight gradient through PyTorch's): ``x (..., K)``, ``weight (N, K)``, ``bias (N,)``
    and ``residual (..., N)`` float32 on the CPU -> ``(..., N)`` float32. Differentiable once: a second
    derivative raises RuntimeError. Equal to ``F.linear`` up to summation order. Needs oneDNN
    (:data:`AVAILABLE`)."""
    out_shape = (*x.shape[:-1], weight.shape[0])
    r = None if residual is None else residual.reshape(-1, weight.shape[0])
    return _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, r).view(out_shape)
