"""Does cleaning pay? On a folder with noisy labels (``planted.py --flip 0.2``), at the same total
wall-clock time, scored on the clean test split:

- **noisy**: ``vitflow train data.path=NOISY train.time_budget=TOTAL``;
- **cleaned**: ``vitflow train`` for ``--first`` of the time, ``vitflow inspect --model`` that run,
  then ``vitflow train data.exclude=exclude.txt model.pretrained=RUN`` for what is left of TOTAL (the
  plan continues a from-scratch run of the same data with its from-scratch recipe, from its weights).

    python benchmarks/quality/planted.py --data ../shared/data/cifar10-jpg.tar --per-class 1000 100 \
        --flip 0.2 --copies 0 --out /tmp/noisy20
    python benchmarks/quality/clean_then_train.py --data /tmp/noisy20 --total 10m --first 4m

Prints one JSON line per arm (top-1 on the whole clean test split, seconds, images excluded and
how many of them were flipped) and the CPU flags. ``--arms cleaned`` runs one arm; ``--set`` gives
every training the same overrides (``--set model.name=mvitv2_cifar_32``); several ``--label-cut``
values (``vitflow inspect --label-cut``) inspect the same first run once each and train one second
run each, given the time left after the first run and that inspection.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vitflow.config import parse_duration  # noqa: E402


def flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in ("amx_tile", "avx512_bf16", "avx2") if f in text})) or "none"


def vitflow(*args: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "vitflow", *args, "--json"] if args[0] == "inspect" else
                         [sys.executable, "-m", "vitflow", args[0], "--json", *args[1:]],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"vitflow {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def test_top1(summary: dict) -> float:
    return summary["test_top1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="a folder planted.py built (its truth.json beside it)")
    ap.add_argument("--total", default="10m", help="each arm's wall-clock time (10m)")
    ap.add_argument("--first", default="4m", help="the cleaned arm's first training (4m)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/clean-then-train"))
    ap.add_argument("--second", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of the cleaned arm's second training (the plan continues the first run with the "
                    "from-scratch recipe for the time left)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every training")
    ap.add_argument("--label-cut", nargs="+", default=["default"], metavar="P",
                    help="vitflow inspect --label-cut P (`default`: its own cut, 0.5 / classes); several: one "
                    "inspection and second run each")
    ap.add_argument("--arms", nargs="+", default=["noisy", "cleaned"], choices=["noisy", "cleaned"])
    a = ap.parse_args()
    truth = json.loads((a.data.parent / f"{a.data.name}.truth.json").read_text())
    cleaned = [f"{d}-{cut}" for cut in a.label_cut for d in ("inspect", "cleaned")]
    for arm in a.arms:
        for d in (("noisy",) if arm == "noisy" else ("first", *cleaned)):
            shutil.rmtree(a.work / d, ignore_errors=True)
    a.work.mkdir(parents=True, exist_ok=True)
    total, first = parse_duration(a.total), parse_duration(a.first)
    print(json.dumps({"cpu_flags": flags(), "data": str(a.data), "flipped": len(truth["flipped"]), "total": a.total,
                      "first": a.first, "seed": a.seed, "set": a.set}))
    common = [f"data.path={a.data}", "train.race=none", f"train.seed={a.seed}", *a.set]
    if "noisy" in a.arms:
        noisy, s = vitflow("train", *common, f"train.time_budget={int(total)}s", f"train.run_dir={a.work / 'noisy'}")
        print(json.dumps({"arm": "noisy", "test_top1": test_top1(noisy), "seconds": round(s, 1)}))
    if "cleaned" not in a.arms:
        return
    t0 = time.perf_counter()
    vitflow("train", *common, f"train.time_budget={int(first)}s", f"train.run_dir={a.work / 'first'}")
    first_s = time.perf_counter() - t0
    for cut in a.label_cut:
        t1 = time.perf_counter()
        found, _ = vitflow("inspect", str(a.data), "--model", str(a.work / "first"), "-o", str(a.work / f"inspect-{cut}"),
                           *([] if cut == "default" else ["--label-cut", cut]))
        excluded = {x for x in Path(found["exclude_txt"]).read_text().splitlines() if x and not x.startswith("#")}
        run = a.work / f"cleaned-{cut}"
        left = total - first_s - (time.perf_counter() - t1)
        vitflow("train", *common, f"train.time_budget={int(left)}s", f"data.exclude={found['exclude_txt']}",
                f"model.pretrained={a.work / 'first'}", f"train.run_dir={run}", *a.second)
        seconds = first_s + time.perf_counter() - t1
        full, _ = vitflow("eval", str(run), "data.exclude=null")  # the whole clean test split
        print(json.dumps({"arm": "cleaned", "label_cut": cut, "test_top1": full["test_top1"],
                          "test_images": full["test_images"], "seconds": round(seconds, 1), "excluded": len(excluded),
                          "excluded_flipped": len(excluded & set(truth["flipped"])), "flipped": len(truth["flipped"])}))


if __name__ == "__main__":
    main()
