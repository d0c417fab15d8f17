"""A photo folder start to finish, as a user runs it: ``vitflow train data.path=PHOTOS`` with nothing
else, timed from the outside, then its last checkpoint scored with ``vitflow eval``.

    python benchmarks/training/photos_budget.py --data PATH|hymenoptera|photos [--tree DIR] [--stop-after SECONDS]
                                       [--json] [key=value ...]

``--data photos`` builds the photo folder of ``tests/helpers.py`` (:func:`photo_folder`: 4,218 real
photos in the 10 CIFAR-10 classes, CIFAR's 32x32 JPEGs and the ImageNet sample's photos of those
classes, train / val / test) under ``benchmarks/.data``; ``hymenoptera`` is the shared tar.
``--tree DIR`` runs another checkout's code (``PYTHONPATH=DIR/src``: e.g. the plan of an older
commit); ``--stop-after`` sends SIGINT that many seconds after the start (a user stopping the run:
vitflow checkpoints and returns). The run's figures come from ``vitflow eval`` of its newest
checkpoint, by the same tree, on the validation split and, when the data has one, the test split.

The run's log, each line with its second, goes to ``train.log`` beside the run folder. Printed (and
with ``--json`` one JSON line): the expected duration the run printed before step 1
and the start-up it announced, the wall time from that line to the end and its ratio to the
expectation, the time of the first evaluation as a fraction of the training time, the steps, the
val / test top-1, and the load average at the start and the end (this machine is shared).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
EXPECTED = re.compile(r"expected duration: ([0-9.]+) (min|s) \((\d+) steps.*after ~([0-9.]+) (min|s) of start-up")
CLOCK = re.compile(r"clock: ([0-9.e+-]+) s a step at batch (\d+)")


def _seconds(value: str, unit: str) -> float:
    return float(value) * (60 if unit == "min" else 1)


def _data(spec: str) -> str:
    if spec == "hymenoptera":
        return str(SHARED / "hymenoptera.tar")
    if spec == "photos":
        folder = ROOT / "benchmarks" / ".data" / "photos"
        if not folder.is_dir():
            sys.path.insert(0, str(ROOT / "tests"))
            from helpers import photo_folder

            partial = folder.with_name("photos.partial")
            photo_folder(partial)
            partial.rename(folder)
        return str(folder)
    return spec


def _run(cmd: list[str], env: dict, stop_after: float | None) -> tuple[int, list[tuple[float, str]], float]:
    """Run ``cmd``; returns its exit code, its stderr lines with the seconds they came at, and its wall time."""
    t0, lines = time.perf_counter(), []
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, bufsize=1)
    stopped = False
    for line in proc.stderr:
        lines.append((time.perf_counter() - t0, line.rstrip()))
        if stop_after and not stopped and time.perf_counter() - t0 > stop_after:
            proc.send_signal(signal.SIGINT)
            stopped = True
    code = proc.wait()
    return code, lines, time.perf_counter() - t0


def _eval(tree: Path, checkpoint: str, env: dict, split_override: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "vitflow", "-q", "eval", checkpoint, *split_override, "--json"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)


def measure(tree: Path, data: str, run: Path, overrides: list[str], stop_after: float | None = None) -> dict:
    """Run ``vitflow train data.path=DATA`` of ``tree``'s code into ``run`` and score its newest
    checkpoint with ``vitflow eval``: the figures printed by :func:`main` (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    load0 = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "vitflow", "train", f"data.path={data}", f"train.run_dir={run}", *overrides]
    code, lines, wall = _run(cmd, env, stop_after)
    load1 = os.getloadavg()[0]
    (run.parent / "train.log").write_text("".join(f"{t:8.1f} {text}\n" for t, text in lines))  # beside the run
    found = next(((t, EXPECTED.search(text)) for t, text in lines if EXPECTED.search(text)), None)
    clock = next((CLOCK.search(text) for _, text in lines if CLOCK.search(text)), None)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    start = next(r for r in records if r["kind"] == "start")
    end = max(r["time"] for r in records)
    race = json.loads((run / "race" / "race.json").read_text()) if (run / "race" / "race.json").is_file() else None
    evals = [r for r in records if r["kind"] == "eval"]
    ckpts = sorted((run / "checkpoints").glob("step-*.pt"))
    test = _eval(tree, str(ckpts[-1]), env, []) if _has_test(data) else {}
    try:
        val = _eval(tree, str(ckpts[-1]), env, ["data.test_split=none"])
    except subprocess.CalledProcessError:  # no validation split (CIFAR-10's tar: train and test)
        val = {}
    r = {"data": data, "tree": str(tree), "exit": code, "wall_s": round(wall, 1), "load_start": load0,
         "load_end": load1, "steps": (val or test)["step"], "val_top1": val.get("val_top1"),
         "test_top1": test.get("test_top1"),
         "val_macro_f1": val.get("val_macro_f1"), "test_macro_f1": test.get("test_macro_f1"),
         "training_s": round(end - start["time"], 1),
         "first_eval_s": round(evals[0]["time"] - start["time"], 1) if evals else None}
    r["first_eval_fraction"] = round(r["first_eval_s"] / r["training_s"], 3) if evals else None
    if found:
        t_line, m = found
        r["expected_s"] = _seconds(m.group(1), m.group(2))
        r["expected_steps"] = int(m.group(3))
        r["startup_expected_s"] = _seconds(m.group(4), m.group(5))
        r["after_expectation_s"] = round(wall - t_line, 1)
        r["ratio_to_expected"] = round(r["after_expectation_s"] / (r["expected_s"] + r["startup_expected_s"]), 3)
    if clock:  # the plan's step time against the run's: all costs in (evaluations, checkpoints) over its steps
        r["planned_step_s"] = float(clock.group(1))
        r["measured_step_s"] = round(r["training_s"] / max(r["steps"], 1), 4)
        if found:
            r["planned_all_in_step_s"] = round(r["expected_s"] / max(r["expected_steps"], 1), 4)
    if race and race.get("planned_step_s", {}).get(race["winner"]):  # a race: the winner's plan and its own time
        r["winner"] = race["winner"]
        r["planned_all_in_step_s"] = race["planned_step_s"][race["winner"]]
        r["measured_step_s"] = round(_own_seconds(records) / max(r["steps"], 1), 4)
    return r


def _own_seconds(records: list[dict]) -> float:
    """A run's own training time: from each ``start`` record (a rung, a continuation) to the last
    record before the next, so that another candidate's rung between two of them is not counted."""
    total, begun, last = 0.0, None, None
    for rec in records:
        if rec["kind"] == "start":
            total += (last - begun) if begun is not None else 0.0
            begun = rec["time"]
        last = rec["time"]
    return total + (last - begun if begun is not None else 0.0)


def _has_test(data: str) -> bool:
    """Whether ``data`` has a ``test`` split: a folder with ``test/``, or a tar with ``*/test/`` members."""
    path = Path(data)
    if path.is_dir():
        return (path / "test").is_dir()
    if path.suffix == ".tar":
        with tarfile.open(path) as tar:
            return any("/test/" in f"/{m.name}" for m in itertools.islice(tar, 100_000))
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="photos", help="a photo folder or tar, or: photos, hymenoptera")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose code runs (default: this one)")
    ap.add_argument("--stop-after", type=float, help="SIGINT the run after this many seconds")
    ap.add_argument("--run-dir", help="where the run goes (default: a new temporary folder)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    tree, data = Path(args.tree).resolve(), _data(args.data)
    run = Path(args.run_dir or tempfile.mkdtemp(prefix="photos-budget-")) / "run"
    r = measure(tree, data, run, args.overrides, args.stop_after)
    found, evals = "expected_s" in r, r["first_eval_s"] is not None
    print(f"{data} ({tree.name}): exit {r['exit']}, {r['steps']} steps"
          + (f", val top-1 {r['val_top1']:.2%}" if r["val_top1"] is not None else "")
          + (f", test top-1 {r['test_top1']:.2%}" if r["test_top1"] is not None else "")
          + (f"; expected {r['expected_s']:.0f} s + {r['startup_expected_s']:.0f} s start-up, took "
             f"{r['after_expectation_s']:.0f} s after that line ({r['ratio_to_expected']:.2f}x)" if found else "")
          + (f"; first evaluation at {r['first_eval_s']:.0f} s of {r['training_s']:.0f} s "
             f"({r['first_eval_fraction']:.1%})" if evals else "; no evaluation during the run")
          + f"; wall {r['wall_s']:.0f} s; load {r['load_start']:.1f} -> {r['load_end']:.1f}")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
