"""Token merging's accuracy curve: top-1 and images/s of a checkpoint against ``r`` (tokens merged per
block, :mod:`vitflow.models.token_merging`), on its own test data, in one process.

    python benchmarks/deployment/token_merging.py RUN_OR_CHECKPOINT [--r 0,2,4,8] [--data PATH] [--split SPLIT]
        [--batch-size 32] [--repeats 3] [--threads N] [--plot curve.png] [--json]

Top-1: every ``r`` on the same decoded images (the checkpoint's test split, else validation; or
``--data``), fp32 eager. Speed: fp32 eager at ``--batch-size`` images a call and batch-1 latency,
``bench infer``'s protocol (:func:`vitflow.infer.bench.timing.time_paths`: every ``r`` in each
round, ``--repeats`` interleaved rounds); the speed-up over ``r=0`` is the median of the per-round
ratios. ``--plot`` writes top-1 and images/s against ``r`` (two axes). The CPU flags are printed.

Smoke run: ``vitflow train train.total_steps=40 train.run_dir=/tmp/d``, then
``python benchmarks/deployment/token_merging.py /tmp/d --r 0,1,2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.infer.bench.timing import cpu_flags, time_paths
from vitflow.infer.calibration import accuracy, checkpoint_split
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.infer.token_merge import merge_candidates
from vitflow.models.token_merging import merge_schedule


def curve(checkpoint: str, rs: list[int] | None, data: str | None, split: str | None, batch_size: int,
          repeats: int) -> dict:
    """``{"rows": [{"r", "tokens_last", "top1", "images_per_s", "speedup", "latency_ms"}], "images", "cpu"}``."""
    state = load_checkpoint(checkpoint)
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    patches, depth = model.grid_size**2, len(model.blocks)
    rs = rs or [0, *merge_candidates(patches, depth)]
    source = checkpoint_split(state, data, split)
    models = {}
    for r in rs:
        models[r] = copy.deepcopy(model)
        models[r].set_token_merge(r)
    top1 = {r: accuracy(m, source, info.preprocess)["top1"] for r, m in models.items()}
    timings = time_paths({f"r={r}": m for r, m in models.items()}, info.preprocess.image_size, batch_size, repeats,
                         latency_calls=10, min_time=1.0, log=lambda m: None)
    base = timings[f"r={rs[0]}"]
    rows = []
    for r in rs:
        t = timings[f"r={r}"]
        rows.append({"r": r, "tokens_last": model.num_prefix_tokens + patches - sum(merge_schedule(r, depth, patches)),
                     "top1": top1[r], "images_per_s": round(statistics.median(t.throughputs), 1),
                     "speedup": round(statistics.median(x / y for x, y in zip(t.throughputs, base.throughputs)), 3),
                     "latency_ms": round(statistics.median(t.latencies_ms), 2)})
    return {"checkpoint": checkpoint, "model": info.model_args["name"], "rows": rows, "images": len(source), "depth": depth, "patches": patches,
            "threads": torch.get_num_threads(), "cpu": cpu_flags()}


def plot(result: dict, out: str) -> None:
    """Top-1 (left axis) and images/s (right axis) against ``r``."""
    from matplotlib.figure import Figure

    rows = result["rows"]
    fig = Figure(figsize=(6, 3.6), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    rs = [r["r"] for r in rows]
    ax.plot(rs, [100 * r["top1"] for r in rows], "o-", color="tab:blue")
    ax.set_xlabel("tokens merged per block (r)")
    ax.set_ylabel("top-1 (%)", color="tab:blue")
    speed = ax.twinx()
    speed.plot(rs, [r["images_per_s"] for r in rows], "s--", color="tab:red")
    speed.set_ylabel("images/s (fp32 eager)", color="tab:red")
    ax.set_title(f"{result['model']}: token merging\ntop-1 on {result['images']} images, {result['threads']} threads, "
                 f"{' '.join(result['cpu'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--r", help="comma-separated r values, the first the baseline (default 0 and the guard's candidates)")
    ap.add_argument("--data", help="labelled data (default: the checkpoint's test split)")
    ap.add_argument("--split")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--plot", help="write the curve as a PNG")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rs = [int(v) for v in args.r.split(",")] if args.r else None
    result = curve(args.checkpoint, rs, args.data, args.split, args.batch_size, args.repeats)
    print(f"{args.checkpoint}: {result['images']} images, {result['depth']} blocks, {result['patches']} patches, "
          f"{result['threads']} threads, CPU flags: {' '.join(result['cpu'])}")
    print(f"{'r':>4s} {'tokens':>6s} {'top-1':>7s} {f'b{args.batch_size} img/s':>10s} {'x r0':>6s} {'b1 ms':>7s}")
    for r in result["rows"]:
        print(f"{r['r']:4d} {r['tokens_last']:6d} {r['top1']:7.2%} {r['images_per_s']:10.1f} {r['speedup']:6.2f} "
              f"{r['latency_ms']:7.2f}")
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
