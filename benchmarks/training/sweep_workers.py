"""Sweeps that many workers share: commands started together on one folder, and ``--workers``.

    python benchmarks/training/sweep_workers.py [--commands 2 4] [--repeats 5] [--trials 12]
    python benchmarks/training/sweep_workers.py --throughput [--repeats 3] [--trials 8]

The first form starts K ``vitflow sweep`` commands at once on a fresh folder (the embedded digits,
``--trials`` trials of ``--steps`` steps each, pruning off), K from ``--commands``, ``--repeats``
times each, and checks what the issue asks: every command exits 0 with no traceback, the folder
holds exactly ``--trials`` complete trials and no failed one, and every trial's run folder is
whole (its config and its summary record). One JSON line per sweep, then a summary line.

``--throughput`` runs the same search with ``--workers 1`` and ``--workers 2`` on this machine, in
turn, ``--repeats`` times, and prints trials per hour of each and their ratio (median of the
rounds), with the CPU flags.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from vitflow.rundir import read_metrics  # noqa: E402

SPACE = "optim.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}\n"
SPLITS = ["data.train_split=train[:80%]", "data.val_split=train[80%:90%]", "data.test_split=train[90%:]"]


def flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in ("amx_tile", "avx512_bf16", "avx2") if f in text})) or "none"


def sweep(work: Path, commands: int, trials: int, steps: int, workers: int = 1) -> dict:
    """Start ``commands`` sweeps at once on one fresh folder; their outcome and the checks."""
    folder = work / "sweep"
    shutil.rmtree(folder, ignore_errors=True)
    space = work / "space.yaml"
    space.write_text(SPACE)
    cmd = [sys.executable, "-m", "vitflow", "-q", "sweep", "--space", str(space), "--trials", str(trials), "--dir",
           str(folder), "--prune-after", str(trials), "--workers", str(workers), "--json",
           f"train.total_steps={steps}", f"train.eval_every={steps}", "optim.warmup_steps=0", *SPLITS]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(commands)]
    outs = [p.communicate() for p in procs]
    seconds = time.perf_counter() - t0
    rows = list(csv.DictReader(open(folder / "sweep.csv"))) if (folder / "sweep.csv").exists() else []
    whole = 0
    for row in rows:
        records = read_metrics(row["run_dir"]) if Path(row["run_dir"], "config.yaml").exists() else []
        whole += any(r["kind"] == "summary" for r in records)
    return {"commands": commands, "workers": workers, "seconds": round(seconds, 1),
            "exit_codes": [p.returncode for p in procs],
            "tracebacks": sum("Traceback" in err for _, err in outs),
            "complete": sum(r["state"] == "complete" for r in rows),
            "failed": sum(r["state"] == "fail" for r in rows), "rows": len(rows), "whole_run_folders": whole,
            "ok": (all(p.returncode == 0 for p in procs) and not any("Traceback" in e for _, e in outs)
                   and len(rows) == trials and whole == trials
                   and all(r["state"] == "complete" for r in rows))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commands", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--steps", type=int, default=60, help="steps of each trial (default 60)")
    ap.add_argument("--throughput", action="store_true", help="--workers 1 against --workers 2, trials per hour")
    a = ap.parse_args()
    print(json.dumps({"cpu_flags": flags(), "trials": a.trials, "steps": a.steps}))
    with tempfile.TemporaryDirectory(prefix="vitflow-sweep-bench-") as tmp:
        work = Path(tmp)
        if a.throughput:
            per_hour: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(a.repeats):
                for workers in (1, 2):
                    r = sweep(work, 1, a.trials, a.steps, workers)
                    per_hour[workers].append(3600 * r["complete"] / r["seconds"])
                    print(json.dumps({**r, "trials_per_hour": round(per_hour[workers][-1])}))
            ratios = [b / a_ for a_, b in zip(per_hour[1], per_hour[2])]
            print(json.dumps({"summary": "throughput", "trials_per_hour_1_worker": round(statistics.median(per_hour[1])),
                              "trials_per_hour_2_workers": round(statistics.median(per_hour[2])),
                              "ratio_median": round(statistics.median(ratios), 2),
                              "ratios": [round(x, 2) for x in ratios]}))
            return
        results = []
        for k in a.commands:
            for _ in range(a.repeats):
                results.append(sweep(work, k, a.trials, a.steps))
                print(json.dumps(results[-1]))
        print(json.dumps({"summary": "shared folder", "sweeps": len(results), "all_ok": all(r["ok"] for r in results),
                          "ok": sum(r["ok"] for r in results)}))


if __name__ == "__main__":
    main()
