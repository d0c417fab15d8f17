"""LoRA fine-tuning against full fine-tuning: training step time and peak memory, side by side.

    python benchmarks/training/lora.py [--model vit_small_patch16_224] [--img-size 224] [--batch 32]
                              [--rank 8] [--pairs 3] [--steps 6] [--json]

Each measurement is a fresh process (so that its peak resident memory is its own): the model of
``--model`` with a 10-class head, AdamW over the parameters that train (vitflow's
``build_optimizer``: torch's fused AdamW on the CPU), fp32, synthetic inputs. ``full`` trains
every parameter; ``lora`` adds rank-``--rank`` adapters (Hu et al. 2021) on the attention's
qkv and output projections (``finetune.mode=lora``'s defaults) and trains only them and the head.
Each process times ``--steps`` training steps after two warm-up steps (median seconds per step)
and reports its peak RSS (``ru_maxrss``) and the RSS after the model was built, whose difference
is the training's own memory: activations, gradients, optimizer state. The two modes alternate,
``--pairs`` times; figures are medians over the pairs and ratios are LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def rss_mb() -> float:
    """This process's current resident memory in MiB (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def measure(mode: str, model_name: str, img_size: int, batch: int, rank: int, steps: int) -> dict:
    """One process's figures for ``mode`` (``full`` or ``lora``)."""
    import vitflow
    from vitflow.config import OptimConfig
    from vitflow.models.lora import apply_lora, is_lora_parameter
    from vitflow.runtime import configure_allocator
    from vitflow.training.optim.optimizers import build_optimizer

    torch.set_num_threads(2)
    configure_allocator()
    torch.manual_seed(0)
    model = vitflow.create_model(model_name, num_classes=10, img_size=img_size)
    if mode == "lora":
        apply_lora(model, rank=rank, alpha=2.0 * rank, targets=("attn.qkv", "attn.proj"))
        for name, p in model.named_parameters():
            p.requires_grad = is_lora_parameter(name) or name.startswith("head.")
    model.train()
    opt = build_optimizer(model, OptimConfig(lr=1e-4, weight_decay=0.05))
    x, y = torch.randn(batch, 3, img_size, img_size), torch.randint(0, 10, (batch,))
    base = rss_mb()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"mode": mode, "step_s": statistics.median(times), "peak_rss_mb": peak, "train_mb": peak - base,
            "trainable": trainable, "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3, help="full / lora process pairs (medians over them)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per process, after 2 warm-up steps")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--one", choices=["full", "lora"], help=argparse.SUPPRESS)  # the measuring child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.img_size, args.batch, args.rank, args.steps)))
        return
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(args.pairs):
        for mode in (("full", "lora") if i % 2 == 0 else ("lora", "full")):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--model", args.model, "--img-size",
                                  str(args.img_size), "--batch", str(args.batch), "--rank", str(args.rank),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "peak_rss_mb", "train_mb")}
           for m, rs in runs.items()}
    print(f"{args.model} at {args.img_size} px, batch {args.batch}, fp32, {args.pairs} process pairs (medians)")
    for m in ("full", "lora"):
        r = runs[m][0]
        print(f"  {m:4s}: {med[m]['step_s']:.2f} s/step ({args.batch / med[m]['step_s']:.1f} img/s), peak RSS "
              f"{med[m]['peak_rss_mb']:.0f} MiB ({med[m]['train_mb']:.0f} MiB over the built model), trainable "
              f"{r['trainable']:,} of {r['params']:,} ({r['trainable'] / r['params']:.2%})")
    ratio = {k: med["lora"][k] / med["full"][k] for k in ("step_s", "peak_rss_mb", "train_mb")}
    print(f"  lora / full: step time {ratio['step_s']:.2f}x, peak RSS {ratio['peak_rss_mb']:.2f}x, "
          f"training memory {ratio['train_mb']:.2f}x")
    if args.json:
        print(json.dumps({"model": args.model, "img_size": args.img_size, "batch": args.batch, "rank": args.rank,
                          "median": med, "ratio": ratio, "runs": runs}))


if __name__ == "__main__":
    main()
