"""Process-level services of the layers (models, data, train, infer): memory allocator and
verbosity, the device and the mixed precision of a run, and seeding.

- :func:`configure_allocator`, :func:`settled_heap`, :func:`quiet`: process settings;
- :func:`resolve_device`, :func:`resolve_precision` (:class:`Precision`: autocast dtype and the
  fp16 gradient scaler), :func:`cpu_bf16_supported`, :func:`cpu_gemm_gflops`;
- :func:`mix_seed` (seeds derived from integers), :func:`rng_state` / :func:`set_rng_state`
  (every RNG of the process, for exact resume).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vitflow import timing
from vitflow.timing import fastest

log = logging.getLogger(__name__)
GEMM_PROBE_SIZE = 1024  # the square product timed by cpu_gemm_gflops
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)


ALT_STACK_BYTES = 256 * 1024
_ALT_STACK: list = []  # the alternate signal stacks ensure_signal_stack gave threads (kept alive while in use)


class _StackT(ctypes.Structure):  # struct stack_t of sigaltstack(2)
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def ensure_signal_stack(size: int = ALT_STACK_BYTES) -> bool:
    """Give the calling thread a ``size``-byte alternate signal stack where it has a smaller one.

    Python's own signal handlers run on a thread's alternate stack when it has one (``SA_ONSTACK``;
    ``faulthandler``, which pytest enables, installs one: 59,760 bytes here). A library loaded by
    ``bench infer``'s peers (ONNX Runtime / OpenVINO / NNCF; not narrowed further) replaced it with
    a 20,144-byte one. On a CPU with AMX the kernel needs 11,952 bytes (``AT_MINSIGSTKSZ`` here) for
    the saved register state alone, so a signal then delivered on that stack — the ``SIGCHLD`` of
    an exiting loader worker or subprocess, whose handler PyTorch's DataLoader installs — could not
    be delivered and the kernel killed the process with ``SIGSEGV`` (``si_code=SI_KERNEL``; seen
    as pytest exiting 139). A thread without an alternate stack
    is left alone (its signal frames go on its own stack). Linux; elsewhere nothing is done.

    Returns:
        whether the thread's alternate stack was replaced.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = _StackT()
        if libc.sigaltstack(None, ctypes.byref(old)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    ss_onstack, ss_disable = 1, 2
    if old.ss_flags & (ss_onstack | ss_disable) or old.ss_size >= size:
        return False
    buf = ctypes.create_string_buffer(size)
    new = _StackT(ctypes.cast(buf, ctypes.c_void_p), 0, size)
    if libc.sigaltstack(ctypes.byref(new), None) != 0:
        return False
    _ALT_STACK.append(buf)
    return True


_THREADS: dict[str, int] = {}  # the thread count before use_threads set one, and the one it set


def use_threads(threads: int | None) -> int:
    """Set torch's intra-op threads for a run or an evaluation in this process: ``threads``, or
    (``None``/0) the count the process had before an earlier call set one — so that a notebook that
    trains a run with ``train.threads=1`` and then one without gets torch's default back, as a new
    ``vitflow train`` process would, not the earlier run's count. A count the user set with
    ``torch.set_num_threads`` in between is kept. Returns the count now in effect."""
    current = torch.get_num_threads()
    before = _THREADS["before"] if _THREADS.get("set") == current else current
    target = threads or before
    if target != current:
        torch.set_num_threads(target)
    _THREADS.update(before=before, set=target)
    return target


@functools.cache
def configure_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Make glibc serve allocations up to ``mmap_threshold`` bytes from its heap and keep freed
    memory (``trim_threshold``), so per-batch tensors (a normalised 64 x 3 x 224 x 224 batch is
    38 MB) reuse resident pages instead of faulting in a fresh ``mmap`` each time.

    Measured here: normalising a uint8 ImageNet-size batch went from 0.56 to 0.07 ms per image;
    the project's CPU baselines found 600k minor page faults per naive attention call from the
    same cause. The cost is that the process keeps its peak heap resident. Returns False (and
    changes nothing) where the C library has no ``mallopt`` (non-glibc systems).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


@contextlib.contextmanager
def settled_heap():
    """While inside: the objects alive on entry (after one collection) are out of the cyclic
    collector's generations (``gc.freeze``); on exit they go back (``gc.unfreeze``), so that a
    process that trains several times (a sweep, a test suite) still collects what a finished run
    left. A training process holds hundreds of thousands of long-lived objects (modules, the model,
    the data index) that every full collection walks: measured here, one 0.17 s collection fell on
    the first batch of a shard stream, triggered by the items it allocates. Entered before the
    loader forks its workers, it also keeps the collector from writing to the pages they share
    with the parent (copy-on-write, as Python's ``gc.freeze`` documentation advises)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def quiet() -> bool:
    """True when vitflow's logger was set to WARNING or above (``vitflow -q``): progress bars are
    hidden then too. Library use (the logger's level unset) keeps them."""
    return logging.getLogger("vitflow").level >= logging.WARNING


# ---------------------------------------------------------------------------------------------
# device and precision


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

    def timed() -> str:
        g = cpu_gemm_gflops()
        name = "bf16" if g["bf16"] > g["fp32"] else "fp32"
        log.info("precision auto: %s (this CPU's GEMM: bf16 %.0f GFLOP/s, fp32 %.0f%s)", name, g["bf16"], g["fp32"],
                 "" if name == "bf16" else "; bf16 autocast would be slower here, set precision bf16 to force it")
        return name

    return timing.choose("precision", "cpu", timed)  # a resumed run's, the machine's cached, or timed


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


# ---------------------------------------------------------------------------------------------
# seeding


def mix_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (NumPy ``SeedSequence``); distinct inputs give
    unrelated seeds."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states, as weights_only-loadable values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
