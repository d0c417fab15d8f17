"""ViT training and inference throughput: vitflow vs timm vs vit-pytorch, side by side.

    python benchmarks/models/models.py [--json] [--quick] [--models cifar,tiny,small] [--repeats 5] [--no-compile]

For vit_tiny_patch16_224 and vit_small_patch16_224 (batch 32) and the 32x32 CIFAR variant
vit_cifar_patch4_32 (dim 192, depth 9, 3 heads, MLP ratio 2, patch 4; batch 64), and for the
pretrained backbones ``dinov2`` (vit_small_patch14_reg4_dinov2 at 224 px, batch 32) and ``siglip``
(vit_base_patch16_siglip_224, batch 16), Swin-T ``swin`` (swin_tiny_patch4_window7_224, batch 32,
window attention through vitflow's ``auto``) and MViTv2-T ``mvit`` (mvitv2_tiny, batch 32, pooling
attention through ``auto``) against timm's model of the same name (vit-pytorch has
none: its column reads ``-``, ``null`` in the JSON), eager and under ``torch.compile`` (inductor,
default mode; the ``timm+compile`` column, left out by ``--no-compile``: its first round of each
cell pays the compilation, 15-60 s, in the untimed warm-up, and later rounds' fresh models reuse the
compiled code), in fp32 and bf16 autocast, it measures images/s of
- training: forward, cross-entropy, backward, AdamW step (lr 1e-4, weight decay 0.05 off norms
  and biases), ``zero_grad``; the optimizer is built as each project's training script builds
  it: vitflow's ``build_optimizer`` (torch's fused AdamW on the CPU), timm's
  ``create_optimizer_v2`` and plain ``torch.optim.AdamW`` for vit-pytorch (both torch's default,
  a per-tensor loop on the CPU);
- inference: ``model.eval()`` under ``torch.inference_mode()``;
for vitflow's ``VisionTransformer`` with ``attention=auto``, timm's ``VisionTransformer`` and
vit-pytorch's ``ViT`` of the same configuration (synthetic inputs). Each cell runs ``--repeats``
rounds; each round builds the three models afresh (the same speed can differ by up to ~8%
between two instances of one model in one process, from where their memory landed, so no
implementation keeps one placement for the whole cell), warms them up (vitflow's ``auto``
times its backends in the first round) and runs every implementation for ``--seconds`` (at
least one step), in an order rotating between rounds. Figures are medians (min-max) over the
rounds. The process uses the glibc allocator settings that ``vitflow train`` applies
(``vitflow.runtime.configure_allocator``: freed memory is kept and reused instead of being
faulted in again per tensor) — for all three implementations alike.

The machine's matmul peak (``torch.mm`` or oneDNN's linear, 1024..4096, fp32 and bf16, best median) gives each
cell's MFU: model FLOPs per image (``FlopCounterMode`` on the explicit-attention forward; x3 for
training) times images/s over the peak of the cell's dtype — for bf16 the higher of the bf16 and
fp32 peaks, since bf16 products can run through either GEMM (``vitflow.models.kernels.matmul``; where
the bf16 GEMM is the slower one, vitflow's ``cpu_bf16_matmul=auto`` picks the fp32 one, shown in
the backend column as ``gemm fp32``; fp32 cells show ``gemm onednn`` or ``gemm torch``, the GEMM of
vitflow's large fp32 linear layers, ``vitflow.models.kernels.onednn``). With ``--json`` the last line is::

    {"cpu": "CPU: ... flags: ...", "peak_gflops": {"fp32": ..., "bf16": ...}, "cells": [{"model": ..., "mode": "train"|"infer",
     "dtype": "fp32"|"bf16", "vitflow_ips": ..., "timm_ips": ..., "timm_compile_ips": ..., "vit_pytorch_ips": ...,
     "vitflow_mfu": ...}, ...]}

``x best`` is vitflow over the fastest peer of the cell (timm eager, timm compiled, vit-pytorch).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import vitflow  # noqa: E402
from vitflow.models import MODELS  # noqa: E402
from vitflow.models.kernels import onednn  # noqa: E402
from vitflow.runtime import configure_allocator  # noqa: E402

MODEL_SPECS = {  # key: (vitflow variant, batch, classes, input size (None: the variant's))
    "tiny": ("vit_tiny_patch16_224", 32, 1000, None),
    "small": ("vit_small_patch16_224", 32, 1000, None),
    "cifar": ("vit_cifar_patch4_32", 64, 10, None),
    # pretrained backbones, against timm's model of the same name (vit-pytorch has none); fine-tuning
    # input sizes: DINOv2 at 224 (16x16 patches of 14 px, 4 registers), SigLIP at its native 224
    "dinov2": ("vit_small_patch14_reg4_dinov2", 32, 1000, 224),
    "siglip": ("vit_base_patch16_siglip_224", 16, 1000, None),
    # hierarchical: Swin-T (shifted 7x7 windows, 4 stages) against timm's model of the same name
    "swin": ("swin_tiny_patch4_window7_224", 32, 1000, None),
    # hierarchical: MViTv2-T (pooling attention, 4 stages) against timm's model of the same name
    "mvit": ("mvitv2_tiny", 32, 1000, None),
}
PLAIN = ("tiny", "small", "cifar")  # plain ViTs: timm's VisionTransformer and vit-pytorch's ViT of the same shape
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def cpu_line() -> str:
    """The CPU's model name, core count and its GEMM-relevant flags (AMX, AVX512-BF16, AVX2) from
    ``/proc/cpuinfo``: the machines these figures come from change."""
    import os
    import re

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"CPU: {os.cpu_count()} cores (no /proc/cpuinfo)"
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = sorted(set(re.findall(r"\b(amx\w*|avx512_bf16|avx2)\b", text)))
    return f"CPU: {name[1] if name else '?'}, {os.cpu_count()} cores; flags: {' '.join(flags) or 'none of amx/avx512_bf16/avx2'}"


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048, 4096), repeats: int = 3) -> float:
    """Best median GFLOP/s over square sizes of ``torch.mm`` and of oneDNN's linear (the GEMM that
    vitflow's linear layers may run on, ``vitflow.models.kernels.onednn``), whichever is faster."""
    gemms = [torch.mm] + ([lambda a, b: onednn.PW(a, b, None, "none", [], "")] if onednn.AVAILABLE else [])
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for gemm in gemms:
            gemm(a, b)
            times = []
            for _ in range(repeats):
                calls, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 0.3 or calls < 2:
                    gemm(a, b)
                    calls += 1
                times.append((time.perf_counter() - t0) / calls)
            best = max(best, 2 * n**3 / statistics.median(times) / 1e9)
    return best


def _addmm_flops(self_shape, mat1_shape, mat2_shape, *args, **kwargs) -> int:
    """FLOPs of ``addmm_`` (``FlopCounterMode`` counts only the out-of-place ``addmm``)."""
    return 2 * mat1_shape[0] * mat1_shape[1] * mat2_shape[1]


def _onednn_linear_flops(x_shape, *args, **kwargs) -> int:
    """FLOPs of oneDNN's linear, ``(x, W, b, attr, ...)`` or its residual form ``(x, other, W, b, attr)``
    (``FlopCounterMode`` knows neither)."""
    w_shape = args[0] if isinstance(args[2], str) else args[1]
    return 2 * x_shape.numel() * w_shape[0]


def flop_counter(extra: dict | None = None):
    """A ``FlopCounterMode`` that also counts vitflow's GEMMs the counter does not know: the blocks'
    proj / fc2 accumulating onto the residual in place (``addmm_``,
    ``vitflow.models.kernels.matmul.Linear``) and oneDNN's linear; ``extra``: more ops and their
    FLOP functions."""
    from torch.utils.flop_counter import FlopCounterMode

    table = {torch.ops.aten.addmm_: _addmm_flops, torch.ops.mkldnn._linear_pointwise: _onednn_linear_flops}
    return FlopCounterMode(display=False, custom_mapping={**table, **(extra or {})})


def forward_gflops(name: str, num_classes: int, size: int) -> float:
    """Forward GFLOP per image at ``size`` px, counted on vitflow's explicit (math) attention path."""
    model = vitflow.create_model(name, num_classes=num_classes, attention="math", img_size=size).eval()
    onednn.fp32_gemm()  # decided before counting: its one-off timing's GEMMs are not the model's
    counter = flop_counter()
    with counter, torch.no_grad():
        model(torch.randn(1, 3, size, size))
    return counter.get_total_flops() / 1e9


def build(impl: str, name: str, num_classes: int, size: int) -> torch.nn.Module:
    """``impl``'s model (``vitflow``, ``timm``, ``timm_compile``: timm's under ``torch.compile``,
    ``vit_pytorch``) of vitflow variant ``name``'s configuration."""
    if impl == "timm_compile":
        return torch.compile(build("timm", name, num_classes, size))
    cfg = MODELS[name]
    dim, depth, heads = cfg["embed_dim"], cfg.get("depth"), cfg["num_heads"]  # (Swin: per-stage depths)
    mlp_ratio = cfg.get("mlp_ratio", 4.0)
    if impl == "vitflow":
        return vitflow.create_model(name, num_classes=num_classes, attention="auto", img_size=size)
    if impl == "timm" and (size != cfg["img_size"] or name not in (MODEL_SPECS[k][0] for k in PLAIN)):
        import timm

        return timm.create_model(name, pretrained=False, num_classes=num_classes, img_size=size)
    if impl == "timm":
        from timm.models.vision_transformer import VisionTransformer

        return VisionTransformer(img_size=cfg["img_size"], patch_size=cfg["patch_size"], embed_dim=dim, depth=depth,
                                 num_heads=heads, mlp_ratio=mlp_ratio, num_classes=num_classes)
    from vit_pytorch import ViT

    return ViT(image_size=cfg["img_size"], patch_size=cfg["patch_size"], num_classes=num_classes, dim=dim,
               depth=depth, heads=heads, mlp_dim=int(dim * mlp_ratio), dim_head=dim // heads)


def optimizer(impl: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW as each project's own training code builds it."""
    if impl == "vitflow":
        from vitflow.config import OptimConfig
        from vitflow.training.optim.optimizers import build_optimizer

        return build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.05))
    if impl in ("timm", "timm_compile"):
        from timm.optim import create_optimizer_v2

        return create_optimizer_v2(model, "adamw", lr=1e-4, weight_decay=0.05)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)


def make_step(impl: str, model: torch.nn.Module, mode: str, dtype: torch.dtype | None, x: torch.Tensor,
              y: torch.Tensor):
    """A closure running one training step or one inference batch of ``impl``'s ``model``."""
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    if mode == "infer":
        model.eval()

        def infer():
            with torch.inference_mode(), autocast():
                model(x)
        return infer
    model.train()
    opt = optimizer(impl, model)

    def train():
        with autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return train


def images_per_s(step, batch: int, seconds: float, min_steps: int = 1) -> float:
    """Images a second of ``step`` (one batch of ``batch`` images a call), called for at least
    ``seconds`` and ``min_steps`` times."""
    n, t0 = 0, time.perf_counter()
    while n < min_steps or time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n * batch / (time.perf_counter() - t0)


def run_cell(key: str, mode: str, dt: str, repeats: int, seconds: float, compiled: bool = True) -> dict:
    """``{implementation: [images/s of each round]}`` of one cell (model ``key``, ``mode``, dtype ``dt``)."""
    name, batch, classes, size = MODEL_SPECS[key]
    size = size or MODELS[name]["img_size"]
    torch.manual_seed(0)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))
    impls = ("vitflow", "timm", *(("timm_compile",) if compiled else ()), *(("vit_pytorch",) if key in PLAIN else ()))
    rates: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(repeats):
        torch.manual_seed(r)  # fresh models each round: no implementation keeps one memory placement
        steps = {impl: make_step(impl, build(impl, name, classes, size), mode, DTYPES[dt], x, y) for impl in impls}
        for impl, step in list(steps.items()):  # warm-up (vitflow's attention=auto decides in the first round)
            try:
                for _ in range(2 if r == 0 else 1):
                    step()
            except Exception as e:  # a model torch.compile cannot run: that peer is left out, in one line
                if impl != "timm_compile":
                    raise
                print(f"{name} {mode} {dt}: timm + torch.compile failed, left out ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})", file=sys.stderr)
                del steps[impl], rates[impl]
                impls = tuple(i for i in impls if i != impl)
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:  # rotate the order between rounds
            rates[impl].append(images_per_s(steps[impl], batch, seconds))
        del steps
        gc.collect()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cifar,tiny,small", help="comma list of " + ", ".join(MODEL_SPECS))
    ap.add_argument("--modes", default="train,infer")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per cell (median reported)")
    ap.add_argument("--seconds", type=float, default=1.5, help="minimum seconds per implementation per round")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--quick", action="store_true", help="CIFAR variant only, 3 rounds of 1 s")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--no-compile", action="store_true", help="leave out the timm + torch.compile peer")
    args = ap.parse_args()
    if args.quick:
        args.models, args.repeats, args.seconds = "cifar", 3, 1.0
    torch.set_num_threads(args.threads)
    configure_allocator()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    # the peaks of the dtypes measured (fp32 always: bf16 cells are rated against the higher of the two);
    # a CPU without native bf16 runs it emulated (~1 GFLOP/s): timing 4096-square products there takes minutes
    peak = {d: matmul_peak(DTYPES[d] or torch.float32) for d in ("fp32", *args.dtypes.split(",")) if d in DTYPES}
    print(cpu_line())
    print(f"matmul peak ({args.threads} threads): " + ", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in peak.items()))
    peers = ("timm", *(() if args.no_compile else ("timm_compile",)), "vit_pytorch")
    heads = {"timm": "timm", "timm_compile": "timm+compile", "vit_pytorch": "vit-pytorch"}
    print(f"{'model':24s} {'mode':5s} {'dtype':5s} {'vitflow img/s':>20s} "
          + " ".join(f"{heads[p]:>18s}" for p in peers) + f" {'x timm':>7s} {'x best':>7s} {'MFU':>5s}  backend")
    cells = []
    for key in args.models.split(","):
        name, _, classes, size = MODEL_SPECS[key]
        gflops = forward_gflops(name, classes, size or MODELS[name]["img_size"])
        for mode in args.modes.split(","):
            for dt in args.dtypes.split(","):
                rates = run_cell(key, mode, dt, args.repeats, args.seconds, not args.no_compile)
                med = {impl: statistics.median(v) for impl, v in rates.items()}
                mfu = med["vitflow"] * gflops * (3 if mode == "train" else 1) / (
                    max(peak.values()) if dt == "bf16" else peak[dt])
                best = max(v for k, v in med.items() if k != "vitflow")
                fmt = {impl: f"{med[impl]:.1f} ({min(v):.3g}-{max(v):.3g})" for impl, v in rates.items()}
                print(f"{name:24s} {mode:5s} {dt:5s} {fmt['vitflow']:>20s} "
                      + " ".join(f"{fmt.get(p, '-'):>18s}" for p in peers)
                      + f" {med['vitflow'] / med['timm']:7.2f} {med['vitflow'] / best:7.2f} {mfu:5.0%}  {_backend(dt)}",
                      flush=True)
                cells.append({"model": name, "mode": mode, "dtype": dt, "vitflow_ips": round(med["vitflow"], 2),
                              **{f"{p}_ips": round(med[p], 2) if p in med else None for p in peers},
                              "vitflow_mfu": round(mfu, 4)})
                gc.collect()
    if args.json:
        print(json.dumps({"cpu": cpu_line(), "peak_gflops": {k: round(v, 1) for k, v in peak.items()}, "cells": cells}))


def _backend(dt: str) -> str:
    """The attention backend(s) and GEMM(s) vitflow's ``auto`` chose in the current cell."""
    backend = ",".join(sorted({k[-1] for k in _auto_choices()})) or "-"
    gemms = _gemm_choices()
    if gemms:
        return backend + ", gemm " + ",".join(gemms)
    if dt == "fp32":  # large fp32 linear layers: oneDNN's GEMM or PyTorch's (vitflow.models.kernels.onednn)
        return backend + ", gemm " + onednn.fp32_gemm()
    return backend


def _auto_choices() -> list[tuple]:
    """(key..., backend) of the choices vitflow's attention=auto made in the current cell."""
    from vitflow.models.attention import auto

    out = [(*k, v) for k, v in auto._CHOICES.items()]
    auto.clear_choices()
    return out


def _gemm_choices() -> list[str]:
    """The GEMMs vitflow's cpu_bf16_matmul=auto chose in the current cell (bf16 cells on a CPU)."""
    from vitflow.models.kernels import matmul

    out = sorted(set(matmul._CHOICES.values()))
    matmul.clear_choices()
    return out


if __name__ == "__main__":
    main()
