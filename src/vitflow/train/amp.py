"""Device and mixed-precision selection: autocast dtype and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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
    """``auto``: bf16 on CUDA with bf16 support (else fp16), bf16 on CPUs with native bf16,
    else fp32.

    Raises:
        ValueError: fp16 asked for on a non-CUDA device.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = "bf16" if device.type == "cpu" and cpu_bf16_supported() else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise ValueError(f"train.precision=fp16 needs a CUDA device (this run is on {device.type}); use bf16 or fp32")
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
    return Precision(name, device.type, dtype, scaler)
