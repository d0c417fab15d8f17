"""Training throughput of one model in eager fp32, AMP bf16, AMP fp16 (loss scaling) and
``torch.compile`` (bf16), side by side in one process: images/s and the ratio to eager fp32.

    python benchmarks/training/gpu_train.py [--model vit_base_patch16_224] [--batch-size 128] [--steps 30] [--json]

Made for a CUDA machine (defaults: ViT-B/16 at 224, batch 128, < 3 minutes on one modern GPU
including compilation); on a CPU it runs the CIFAR ViT at batch 128 and skips fp16 (CUDA-only in
vitflow). Every mode runs the trainer's own step pieces (``Precision.autocast`` / ``backward`` /
``clip_grad_norm`` / ``step``, AdamW over vitflow's parameter groups) on synthetic inputs, with
``--warmup`` untimed steps first (compilation happens there), then ``--steps`` timed steps,
synchronising the device at both ends. Modes are interleaved over ``--repeats`` rounds and the
median images/s is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vitflow import create_model
from vitflow.config import OptimConfig
from vitflow.runtime import resolve_precision
from vitflow.training.optim.optimizers import build_optimizer


def make_step(model_name: str, batch: int, precision: str, compiled: bool, device: torch.device):
    model = create_model(model_name, num_classes=1000 if "224" in model_name else 10,
                         attention="sdpa" if device.type == "cuda" else "math").to(device)
    opt = build_optimizer(model, OptimConfig(lr=1e-3))
    prec = resolve_precision(precision, device)
    net = torch.compile(model) if compiled else model
    size = model.img_size
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)

    def step() -> None:
        with prec.autocast():
            loss = torch.nn.functional.cross_entropy(net(x).float(), y, label_smoothing=0.1)
        prec.backward(loss)
        prec.clip_grad_norm(opt, model.parameters(), 1.0)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_base_patch16_224" if cuda else "vit_cifar_patch4_32")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30 if cuda else 8, help="timed steps per mode and round")
    ap.add_argument("--warmup", type=int, default=5 if cuda else 2, help="untimed steps (compilation) per mode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager_fp32,amp_bf16,amp_fp16,compile_bf16" if cuda else
                    "eager_fp32,amp_bf16,compile_bf16")
    ap.add_argument("--json", action="store_true", help="end with one JSON line {mode: images/s, ...}")
    args = ap.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    else:
        print(f"device: CPU ({torch.get_num_threads()} threads), torch {torch.__version__}")
    specs = {"eager_fp32": ("fp32", False), "amp_bf16": ("bf16", False), "amp_fp16": ("fp16", False),
             "compile_bf16": ("bf16", True)}
    steps, rates = {}, {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        steps[mode] = make_step(args.model, args.batch_size, *specs[mode], device)
        for _ in range(args.warmup):
            steps[mode]()
        sync(device)
        rates[mode] = []
        print(f"{mode}: ready in {time.perf_counter() - t0:.1f} s (warm-up and compilation)", flush=True)
    for _ in range(args.repeats):
        for mode, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(device)
            rates[mode].append(args.steps * args.batch_size / (time.perf_counter() - t0))
    base = statistics.median(rates["eager_fp32"]) if "eager_fp32" in rates else None
    result = {}
    print(f"{args.model}, batch {args.batch_size}: training images/s, median of {args.repeats} x {args.steps} steps")
    for mode, r in rates.items():
        med = result[mode] = statistics.median(r)
        ratio = f"  {med / base:.2f}x eager fp32" if base else ""
        print(f"  {mode:14s} {med:9.1f} img/s  (min {min(r):.1f}, max {max(r):.1f}){ratio}")
    if args.json:
        print(json.dumps({"model": args.model, "batch_size": args.batch_size, "device": str(device),
                          "images_per_s": result}))


if __name__ == "__main__":
    main()
