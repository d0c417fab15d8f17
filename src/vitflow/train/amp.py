"""Device and mixed-precision selection: autocast dtype and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch

from vitflow.models.timing import fastest

log = logging.getLogger(__name__)
GEMM_PROBE_SIZE = 1024  # the square product timed by cpu_gemm_gflops


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``.

    Raises:
        ValueError: a CUDA device was asked for and none is available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but no CUDA device is available; use train.device=cpu")
    return dev


def cpu_bf16_supported() -> bool:
    """True when oneDNN has native bf16 kernels on this CPU (AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_gemm_gflops() -> dict[str, float]:
    """GFLOP/s of this CPU's fp32 and bf16 GEMMs (``torch.mm`` of a constant
    ``GEMM_PROBE_SIZE``-square matrix with itself, current thread count; fastest of 3 calls after
    a warm-up, rotating order; measured once per process, ~0.1 s; the RNG is not touched).
    Returns ``{"fp32": ..., "bf16": ...}``."""
    n = GEMM_PROBE_SIZE
    a = torch.full((n, n), 0.5)
    a16 = a.to(torch.bfloat16)
    best = fastest({"fp32": lambda: a @ a, "bf16": lambda: a16 @ a16}, rounds=3)
    return {k: 2 * n**3 / t / 1e9 for k, t in best.items()}


def _cpu_auto_precision() -> str:
    """bf16 where the CPU has native bf16 kernels and its bf16 GEMM outruns the fp32 one; fp32
    otherwise. Without AMX (e.g. AVX512-BF16 only, as on the project's machine: bf16 ~190 GFLOP/s
    vs fp32 ~340) bf16 autocast makes ViT training and inference slower (measured here: the
    ``cifar10-vit-tiny`` preset trains at 0.84x the images/s of fp32, ViT inference runs at
    0.73-0.96x), so ``auto`` keeps fp32 there."""
    if not cpu_bf16_supported():
        return "fp32"
    g = cpu_gemm_gflops()
    name = "bf16" if g["bf16"] > g["fp32"] else "fp32"
    log.info("precision auto: %s (this CPU's GEMM: bf16 %.0f GFLOP/s, fp32 %.0f%s)", name, g["bf16"], g["fp32"],
             "" if name == "bf16" else "; bf16 autocast would be slower here, set precision bf16 to force it")
    return name


@dataclass
class Precision:
    """Autocast settings for one run.

    ``dtype`` is ``None`` for fp32. ``scaler`` is a :class:`torch.amp.GradScaler` for fp16 only
    (dynamic loss scaling, Micikevicius et al. 2018); bf16 needs none.
    """

    name: str
    device_type: str
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the fp16 loss scale when there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, params, max_norm: float | None) -> float:
        """Unscale the gradients (fp16), clip their global L2 norm to ``max_norm`` (``None``: no
        clipping) and return the norm before clipping (``inf``/``nan`` when non-finite)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor

    def step(self, optimizer: torch.optim.Optimizer, take: bool = True) -> None:
        """Apply the optimizer step when ``take`` (fp16: unless the scaler found an overflow) and
        update the loss scale."""
        if self.scaler is None:
            if take:
                optimizer.step()
            return
        if take:
            self.scaler.step(optimizer)
        self.scaler.update()


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``auto``: bf16 on CUDA with bf16 support (else fp16); on a CPU bf16 where it has native
    bf16 kernels and its bf16 GEMM is faster than its fp32 GEMM (timed once, see
    :func:`_cpu_auto_precision`), else fp32.

    Raises:
        ValueError: fp16 asked for on a non-CUDA device.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = _cpu_auto_precision() if device.type == "cpu" else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"train.precision=fp16 needs a CUDA device (this run is on {device.type}); use bf16 or fp32")
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    return Precision(name, device.type, dtype, scaler)
