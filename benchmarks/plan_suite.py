"""The plan on many real folders: ``vitflow train data.path=FOLDER`` (nothing else but the budget
and the seed) on each folder of ``benchmarks/folders/manifest.json``, for one or more checkouts
side by side, and one table.

    python benchmarks/plan_suite.py [--folders DIR] [--only NAME ...] [--budget 5m] [--seeds 0 1]
                                    [--tree LABEL=DIR ...] [--set LABEL:KEY=VALUE ...]
                                    [--results FILE] [--table-only]

``--folders``: where ``benchmarks/folders/fetch.py`` wrote the folders (CIFAR-10 and hymenoptera
are read from ``../shared/data``). ``--tree LABEL=DIR`` runs another checkout's code (e.g.
``before=/tmp/parent`` for the plan of this commit's parent; default: this checkout as ``now``).
``--set LABEL:KEY=VALUE`` adds an override to that tree's runs (e.g. ``--tree now=. norace=.
--set norace:train.race=none``: the same code without its race).
Each run is ``train.default_budget=BUDGET train.seed=SEED`` (the plan fits itself to the budget as
it does to its 15-minute default), through ``benchmarks/training/photos_budget.py``: figures from
``vitflow eval`` of the newest checkpoint. Every run appends one JSON line to ``--results``
(default ``benchmarks/.data/plan_suite.jsonl``); a run already there is not run again, so an
interrupted suite continues where it stopped, and ``--table-only`` prints the table of what is
there.

The table, per folder and tree: test top-1 of each seed (val where the folder has no test split),
their mean and spread (max - min), test macro-F1's mean, the run's duration over what the plan
stated, and the plan's step time (all costs in: evaluations, checkpoints) over the run's. Below
it, per tree: the median over folders of the mean top-1; per tree after the first: the median of
its folder-by-folder differences from the first (the paired comparison) and on how many folders it
is ahead, and the folders where it is behind the first by more than the larger seed spread of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "training"))
sys.path.insert(0, str(HERE / "folders"))
from fetch import load_manifest  # noqa: E402
from photos_budget import measure  # noqa: E402

SHARED = Path(os.environ.get("VITFLOW_SHARED_DATA", ROOT.parent / "shared" / "data"))


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return " ".join(sorted(f for f in {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"} if f" {f}" in text))


def _data(entry: dict, folders: Path) -> Path:
    return SHARED / entry["shared"] if "shared" in entry else folders / entry["name"]


def _read(results: Path) -> list[dict]:
    return [json.loads(x) for x in results.read_text().splitlines() if x.strip()] if results.is_file() else []


def _top1(r: dict) -> float:
    return r["test_top1"] if r.get("test_top1") is not None else r["val_top1"]


def table(rows: list[dict], trees: list[str], names: list[str]) -> str:
    """The suite's table (see the module docstring) of ``rows``, the results of :func:`main`."""
    out = [f"{'folder':20s} {'tree':8s} {'top-1 by seed (%)':26s} {'mean':>6s} {'spread':>6s} {'F1':>6s} "
           f"{'took/stated':>11s} {'step planned/run':>16s}"]
    means: dict[str, dict[str, tuple[float, float]]] = {t: {} for t in trees}
    for name in names:
        for tree in trees:
            runs = sorted((r for r in rows if r["folder"] == name and r["label"] == tree), key=lambda r: r["seed"])
            if not runs:
                continue
            top = [_top1(r) * 100 for r in runs]
            f1 = [r.get("test_macro_f1") or r.get("val_macro_f1") for r in runs]
            took = [r["ratio_to_expected"] for r in runs if r.get("ratio_to_expected")]
            step = [r["planned_all_in_step_s"] / r["measured_step_s"] for r in runs
                    if r.get("planned_all_in_step_s") and r.get("measured_step_s")]
            spread = max(top) - min(top)
            means[tree][name] = (statistics.mean(top), spread)
            out.append(f"{name:20s} {tree:8s} {' '.join(f'{t:5.1f}' for t in top):26s} {statistics.mean(top):6.1f} "
                       f"{spread:6.1f} {statistics.mean(x for x in f1 if x is not None) * 100 if any(f1) else 0:6.1f} "
                       f"{statistics.mean(took) if took else float('nan'):11.2f} "
                       f"{statistics.mean(step) if step else float('nan'):16.2f}")
    for tree in trees:
        if means[tree]:
            out.append(f"{tree}: median over {len(means[tree])} folders of the mean top-1: "
                       f"{statistics.median(m for m, _ in means[tree].values()):.1f}%")
    first = trees[0]
    for tree in trees[1:]:  # paired by folder: the median of levels is whichever folder sits in the middle
        diff = {n: means[tree][n][0] - means[first][n][0] for n in means[tree] if n in means[first]}
        if diff:
            out.append(f"{tree} - {first}, folder by folder: median {statistics.median(diff.values()):+.1f} "
                       f"points, ahead on {sum(d > 0 for d in diff.values())} of {len(diff)}")
        behind = [f"{n} ({d:+.1f})" for n, d in diff.items() if -d > max(means[first][n][1], means[tree][n][1])]
        out.append(f"{tree} behind {first} by more than the seed spread on: {', '.join(behind) or 'none'}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folders", default=str(ROOT / "benchmarks" / ".data" / "folders"))
    ap.add_argument("--only", nargs="*", help="these folders only (names of the manifest)")
    ap.add_argument("--budget", default="5m")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0])
    ap.add_argument("--tree", nargs="*", default=[f"now={ROOT}"], help="LABEL=DIR: a checkout whose code runs")
    ap.add_argument("--set", nargs="*", default=[], help="LABEL:KEY=VALUE: an override of that tree's runs")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / ".data" / "plan_suite.jsonl"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    entries = [e for e in load_manifest() if not args.only or e["name"] in args.only]
    trees = dict(t.split("=", 1) for t in args.tree)
    extra: dict[str, list[str]] = {label: [] for label in trees}
    for item in args.set:
        label, _, override = item.partition(":")
        if label not in trees or "=" not in override:
            ap.error(f"--set {item}: not LABEL:KEY=VALUE with a LABEL of --tree ({', '.join(trees)})")
        extra[label].append(override)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores; budget {args.budget}; seeds {args.seeds}", flush=True)
    for seed in ([] if args.table_only else args.seeds):  # seed-major: a partial suite has every folder once
        for entry in entries:
            for label, tree in trees.items():
                done = {(r["label"], r["folder"], r["seed"], r["budget"]) for r in _read(results)}
                if (label, entry["name"], seed, args.budget) in done:
                    continue
                run = results.parent / "runs" / f"{label}-{entry['name']}-s{seed}-{args.budget}"
                if run.exists():
                    subprocess.run(["rm", "-rf", str(run)], check=True)
                run.mkdir(parents=True)
                r = measure(Path(tree).resolve(), str(_data(entry, Path(args.folders))), run / "run",
                            [f"train.default_budget={args.budget}", f"train.seed={seed}", *extra[label]])
                r.update(label=label, overrides=extra[label], folder=entry["name"], seed=seed, budget=args.budget, cpu=cpu_flags())
                with results.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"{label} {entry['name']} seed {seed}: top-1 {_top1(r):.2%}, {r['steps']} steps, "
                      f"took/stated {r.get('ratio_to_expected')}", flush=True)
    rows = [r for r in _read(results) if r["budget"] == args.budget and r["label"] in trees]
    print(f"budget {args.budget}; CPU flags of the runs: {', '.join(sorted({r.get('cpu', '?') for r in rows}))}; "
          f"seeds {sorted({r['seed'] for r in rows})}")
    print(table(rows, list(trees), [e["name"] for e in entries]))


if __name__ == "__main__":
    main()
