"""Test-time augmentation on a trained checkpoint: top-1 (and loss) without and with each TTA, and the
cost in images/s of the whole evaluation pass (decoding included), on the checkpoint's test split.

    python benchmarks/deployment/tta.py RUN_OR_CHECKPOINT [--tta none,flip,flip+crops5] [--device auto] [--json]
        [key=value ...]

``--tta`` lists the specs to compare, separated by ``;`` or ``+``-joined parts (``flip+crops5`` is
``--tta flip,crops5``), e.g. for the 15-minute CIFAR-10 checkpoint of ``benchmarks/training/cifar10_budget.py``::

    python benchmarks/training/cifar10_budget.py --budget 15m train.run_dir=runs/c10
    python benchmarks/deployment/tta.py runs/c10 --tta "none;flip;flip+crops5"

Smoke run: a tiny digits run (``vitflow train train.total_steps=20 train.run_dir=/tmp/d``), then
``python benchmarks/deployment/tta.py /tmp/d``.
"""

from __future__ import annotations

import argparse
import json
import re

from vitflow.infer.evaluate import evaluate_checkpoint


def compare(checkpoint: str, specs: list[str], overrides: list[str], device: str | None = None,
            repeats: int = 2) -> list[dict]:
    """``evaluate_checkpoint`` ``repeats`` times per spec (the fastest pass's images/s: the first pass
    also warms the page cache and the kernels): ``[{"tta", "top1", "loss", "images", "images_per_s"}, ...]``."""
    rows = []
    for spec in specs:
        runs = [evaluate_checkpoint(checkpoint, overrides, device=device, tta=spec) for _ in range(max(1, repeats))]
        r, role = runs[-1], runs[-1]["split"]
        rows.append({"tta": r["tta"], "top1": r[f"{role}_top1"], "loss": r[f"{role}_loss"],
                     "images": r[f"{role}_images"], "images_per_s": max(x["images_per_s"] for x in runs),
                     "split": r["split_expr"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run directory or checkpoint")
    ap.add_argument("--tta", default="none;flip", help="specs to compare, ';'-separated, parts '+'-joined")
    ap.add_argument("--device", help="default: the checkpoint's train.device")
    ap.add_argument("--repeats", type=int, default=2, help="passes per spec; the fastest is reported (default 2)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. data.path=...")
    args = ap.parse_args()
    specs = [s.replace("+", ",") for s in re.split(r";", args.tta) if s.strip()]
    rows = compare(args.checkpoint, specs, args.overrides, args.device, args.repeats)
    base = rows[0]
    print(f"{args.checkpoint}: {base['images']} images of {base['split']}")
    print(f"{'tta':24s} {'top-1':>7s} {'loss':>7s} {'images/s':>9s} {'cost':>6s}")
    for r in rows:
        print(f"{r['tta']:24s} {r['top1']:7.2%} {r['loss']:7.4f} {r['images_per_s']:9.0f} "
              f"{base['images_per_s'] / max(r['images_per_s'], 1e-9):5.1f}x")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
