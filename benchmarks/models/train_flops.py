"""Achieved training GFLOP/s of the model families the plan races, side by side in one process.

    python benchmarks/models/train_flops.py [--sizes 32,64] [--batch 128] [--rounds 5] [--seconds 3]
                                            [--dtype fp32|bf16] [--json]

For each input size, the plan's compact ViT and the two families raced against it at the same token
grid (``vitflow.training.plan.rivals.RIVALS``: at 32 px ``vit_cifar_patch4_32``, ``mvitv2_cifar_32``,
``swin_cifar_patch2_window4_32``; at 64 px ``vit_compact_patch8_64``, ``mvitv2_compact_64``,
``swin_compact_patch4_window4_64``), built as the plan trains them on a CPU: the ViT with
``attention=math`` and PatchDropout 0.5, the others with ``attention=auto`` (their backends timed). It times training steps (forward, cross-entropy, backward, vitflow's
AdamW, ``zero_grad``; synthetic inputs, 10 classes) for ``--seconds`` per model per round, the models
in an order rotating between rounds, and prints per model the median images/s (min-max), the FLOPs
of one training image and their product, the achieved GFLOP/s, with its ratio to the ViT's.

The FLOPs of a training image are counted, not estimated: ``FlopCounterMode`` over one training
step's forward and backward in train mode (PatchDropout's dropped tokens are not counted: they are
not computed), with the GEMMs that vitflow runs in place (``addmm_``, oneDNN's linear) and
vitflow's own pooling kernel of MViTv2 (a depthwise k x k convolution: ``2 k^2`` FLOPs per output
value forward, twice that backward) added to the counter's table. Normalisation and activation
FLOPs count for no model. The process applies ``vitflow.runtime.configure_allocator`` as
``vitflow train`` does. With ``--json`` the last line is::

    {"cpu": "...", "dtype": "fp32", "batch": 128, "rows": [{"size": 32, "model": ..., "ips": ...,
     "train_gflop_per_image": ..., "gflops": ..., "ratio_to_vit": ...}, ...]}
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vitflow  # noqa: E402
from models import cpu_line, flop_counter, images_per_s, make_step  # noqa: E402
from vitflow.models.kernels import cpp, onednn  # noqa: E402
from vitflow.models.registry import family_of  # noqa: E402
from vitflow.runtime import configure_allocator  # noqa: E402
from vitflow.training.plan.rivals import RIVALS  # noqa: E402

PLAN_ARGS = {"vit": dict(attention="math", patch_drop_rate=0.5)}  # per family; the race's others: attention=auto


def _pool_forward_flops(qkv_shape, wq, wk, wv, prefix, h, w, heads, kernel, *args, out_shape=None, **kwargs) -> int:
    """vitflow's MViTv2 pooling forward: a depthwise ``kernel`` x ``kernel`` convolution per output value."""
    return sum(2 * kernel * kernel * torch.Size(s).numel() for s in out_shape)


def _pool_backward_flops(gq, gk, gv, qkv, wq, wk, wv, prefix, h, w, heads, kernel, *args, **kwargs) -> int:
    """Its backward: the input's gradient and the kernels' gradient, each as many FLOPs as the forward."""
    return sum(4 * kernel * kernel * torch.Size(s).numel() for s in (gq, gk, gv))


def counter():
    """:func:`models.flop_counter` with vitflow's MViTv2 pooling kernel (where it is built)."""
    if not cpp.available():
        return flop_counter()
    return flop_counter({torch.ops.vitflow.pool_qkv_forward: _pool_forward_flops,
                         torch.ops.vitflow.pool_qkv_backward: _pool_backward_flops})


def build(name: str) -> torch.nn.Module:
    family = family_of(name).name
    return vitflow.create_model(name, num_classes=10, **PLAN_ARGS.get(family, dict(attention="auto")))


def train_gflop(name: str, size: int, dtype: torch.dtype | None) -> float:
    """GFLOP of one training image (forward + backward), counted on a batch of 8 after a warm-up step
    (``attention=auto`` times its backends there, uncounted)."""
    model = build(name).train()
    onednn.fp32_gemm()  # decided before counting: its one-off timing's GEMMs are not the model's
    x, y = torch.randn(8, 3, size, size), torch.randint(0, 10, (8,))
    step = make_step("vitflow", model, "train", dtype, x, y)
    step()
    with counter() as c:
        step()
    return c.get_total_flops() / 8 / 1e9


def measure(names: list[str], size: int, batch: int, dtype: torch.dtype | None, rounds: int,
            seconds: float) -> dict[str, list[float]]:
    """Training images/s per model, ``rounds`` rounds of ``seconds`` each, fresh models every round."""
    rates: dict[str, list[float]] = {n: [] for n in names}
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.manual_seed(r)
            step = make_step("vitflow", build(name), "train", dtype, x, y)
            step()
            step()
            rates[name].append(images_per_s(step, batch, seconds, min_steps=2))
            del step
            gc.collect()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="32,64", help="input sizes: 32 (CIFAR) and/or 64 (photo folders)")
    ap.add_argument("--batch", type=int, default=128, help="the plan's batch on a CPU (default 128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per model per round")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as the plan "
                    "trains where the CPU has native bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_allocator()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    plans = {32: "vit_cifar_patch4_32", 64: "vit_compact_patch8_64"}
    cpu = cpu_line()
    print(f"{cpu}; {args.threads} threads, {args.dtype}, batch {args.batch}, {args.rounds} round(s) of "
          f"{args.seconds:g} s, torch {torch.__version__}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        names = [plans[size], *RIVALS[plans[size]]]
        flops = {n: train_gflop(n, size, dtype) for n in names}
        rates = measure(names, size, args.batch, dtype, args.rounds, args.seconds)
        base = flops[names[0]] * statistics.median(rates[names[0]])
        print(f"\n{size} px{'':27} {'img/s (min-max)':>22} {'GFLOP/img':>10} {'GFLOP/s':>8} {'x ViT':>6}")
        for n in names:
            ips = statistics.median(rates[n])
            gflops = flops[n] * ips
            rows.append(dict(size=size, model=n, ips=round(ips, 1), ips_rounds=[round(v, 1) for v in rates[n]],
                             train_gflop_per_image=round(flops[n], 4), gflops=round(gflops, 1),
                             ratio_to_vit=round(gflops / base, 3)))
            spread = f"{ips:.1f} ({min(rates[n]):.1f}-{max(rates[n]):.1f})"
            print(f"  {n:32} {spread:>22} {flops[n]:10.3f} {gflops:8.1f} {gflops / base:6.2f}")
    if args.json:
        print(json.dumps(dict(cpu=cpu, dtype=args.dtype, batch=args.batch, rows=rows)))


if __name__ == "__main__":
    main()
