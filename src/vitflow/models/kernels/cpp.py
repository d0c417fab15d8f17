"""vitflow's own CPU kernels (C++ in ``vitflow/models/kernels/csrc``), compiled on first use for this CPU.

The sources are built with ``torch.utils.cpp_extension.load`` (a C++17 compiler and ninja; a few
seconds, once: the library is cached under ``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) with ``-O3 -march=native`` and PyTorch's OpenMP, and register
their operators under ``torch.ops.vitflow``: ``window_attention_forward`` / ``_backward``
(:func:`vitflow.models.attention.window.fused_window_attention`) and ``layer_norm_backward``
(:class:`vitflow.models.layers.LayerNorm`, Swin's norms) and ``pool_qkv_forward`` / ``_backward``
(:func:`vitflow.models.kernels.pool.pool_qkv`, MViTv2's conv pooling) and ``add_layer_norm`` / ``_backward``
(:func:`vitflow.models.kernels.norm.add_layer_norm`, a ViT block's residual add and LayerNorm under bf16
autocast). The library's name carries a fingerprint of the
CPU's instruction sets and of the sources, so a cache shared between machines never hands one
CPU's build to another, and an edited source is rebuilt.

Where the build is impossible (no compiler, no ninja, a non-x86 or non-Linux host, or
``VITFLOW_CPU_KERNELS=0`` in the environment) :func:`available` is False, one warning line says
why, and every caller runs its PyTorch path instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from vitflow.timing import cpu_flags

log = logging.getLogger(__name__)

SOURCES = ("window_attention.cpp", "layer_norm.cpp", "pool_qkv.cpp", "add_layer_norm.cpp")  # plus the header vec.h
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _fingerprint() -> str:
    """8 hex digits of the CPU's model and flag list (:func:`vitflow.timing.cpu_flags`) and of
    the sources and header: a new CPU or a changed source gets its own build."""
    digest = hashlib.sha1(cpu_flags().encode())
    for path in sorted(Path(__file__).with_name("csrc").iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def _build() -> None:
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its import warns about CUDA on CPU-only hosts
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
    finally:
        quiet.setLevel(level)

    csrc = Path(__file__).with_name("csrc")
    log.info("loading vitflow's CPU kernels (built once per CPU and source version, a few seconds)")
    load(name=f"vitflow_cpu_{_fingerprint()}", sources=[str(csrc / s) for s in SOURCES],
         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
         verbose=False)


def available() -> bool:
    """Whether ``torch.ops.vitflow`` has vitflow's CPU kernels (building them on the first call)."""
    with _LOCK:
        if "ok" not in _STATE:
            reason = None
            if os.environ.get("VITFLOW_CPU_KERNELS", "1") == "0":
                reason = "VITFLOW_CPU_KERNELS=0"
            elif platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
                reason = f"built for x86-64 Linux only, this is {platform.system()} {platform.machine()}"
            else:
                try:
                    _build()
                except Exception as e:  # compiler, ninja or headers missing: the PyTorch paths remain
                    reason = f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            _STATE["ok"] = reason is None
            if reason:
                log.warning("vitflow CPU kernels unavailable (%s): using PyTorch's kernels instead", reason)
        return bool(_STATE["ok"])


def ops():
    """``torch.ops.vitflow`` after :func:`available`. Raises RuntimeError when the kernels are unavailable."""
    if not available():
        raise RuntimeError("vitflow's CPU kernels are unavailable here (see the warning logged above)")
    return torch.ops.vitflow
