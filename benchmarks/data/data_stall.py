"""Data stall of cifar10-vit-tiny training: the fraction of wall time the loop waits for the
next batch, from the ``data_stall`` field of ``metrics.jsonl``, for several input paths in one run.

    python benchmarks/data/data_stall.py [--steps 120] [--packed DIR] [--tar PATH]

Paths: the packed raw dataset (batched, in RAM), the JPEG tar decoded into the RAM cache
(batched), and the JPEG tar decoded per image in worker processes every epoch (no cache).
Prints the median stall over the logged intervals (the first interval, with start-up, excluded).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from vitflow.config import build_config
from vitflow.rundir import read_metrics
from vitflow.training import Trainer

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def stall(data_path: str, steps: int, *overrides: str) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as run:
        cfg = build_config("cifar10-vit-tiny", overrides=[
            f"data.path={data_path}", f"train.total_steps={steps}", "train.log_every=10", "train.eval_every=0",
            "data.test_split=test[:512]", f"train.run_dir={run}", "train.checkpoint_every=0", *overrides])
        tr = Trainer(cfg)
        desc = tr.loader.describe()
        tr.fit()
        recs = [r for r in read_metrics(Path(run) / "metrics.jsonl") if r["kind"] == "train"][1:]
    return statistics.median(r["data_stall"] for r in recs), statistics.median(r["images_per_s"] for r in recs), desc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--packed", help="packed CIFAR-10 (vitflow prepare); made in a temp dir if not given")
    ap.add_argument("--tar", default=str(SHARED / "cifar10-jpg.tar"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        packed = args.packed
        if packed is None:
            from vitflow.data.prepare import prepare

            packed = str(Path(tmp) / "cifar10-packed")
            prepare(args.tar, packed, workers=2)
        for label, path, extra in [("packed raw (batched)", packed, ()),
                                   ("JPEG tar, RAM cache (batched)", args.tar, ()),
                                   ("JPEG tar, per-image decode every epoch", args.tar,
                                    ("data.max_in_memory=0", "data.num_workers=2"))]:
            s, ips, desc = stall(path, args.steps, *extra)
            print(f"{label:42s} data stall {s:6.1%}   {ips:6.0f} img/s   [{desc}]", flush=True)


if __name__ == "__main__":
    main()
