"""What a sweep writes from its storage into the sweep folder: ``sweep.csv`` (a row per trial),
``best.yaml`` (the best trial's config) and the summary; any worker rewrites them after each of
its trials (written whole, renamed into place)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import yaml

from vitflow.training.sweep.storage import counted

TABLE, BEST = "sweep.csv", "best.yaml"


def _note(t) -> str:
    if t.user_attrs.get("note"):
        return t.user_attrs["note"]
    if t.user_attrs.get("interrupted"):
        return "interrupted"
    if t.state.name == "FAIL" and "seconds" not in t.user_attrs:
        return "worker lost (no heartbeat)"
    return ""


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per writer: several workers write the folder


def write_table(study, path: Path) -> None:
    """``sweep.csv``: one row per trial (trial, state, value, the sampled keys, run_dir, seconds,
    note; surplus ones left out), written whole and renamed into place."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
    keys = sorted({k for t in trials for k in t.params})
    tmp = _tmp(path)
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "state", "value", *keys, "run_dir", "seconds", "note"])
        for t in trials:
            w.writerow([t.number, t.state.name.lower(), "" if t.value is None else t.value,
                        *[t.params.get(k, "") for k in keys], t.user_attrs.get("run_dir", ""),
                        t.user_attrs.get("seconds", ""), _note(t)])
    tmp.replace(path)


def best_trial(study):
    """The best complete trial, or ``None`` before one completes."""
    try:
        return study.best_trial
    except ValueError:
        return None


def write_best(study, path: Path, metric: str) -> Path | None:
    """``best.yaml``: the best trial's full config (its run's ``config.yaml``, kept in the storage
    so that a trial another machine ran is written too, without the run directory), loadable with
    ``vitflow train --config best.yaml``; ``None`` before a trial completes."""
    best = best_trial(study)
    if best is None:
        return None
    text = best.user_attrs.get("config") or (Path(best.user_attrs["run_dir"]) / "config.yaml").read_text()
    tree = yaml.safe_load(text)
    tree["train"].update(run_dir=None, resume="none")
    head = (f"# best of {len(study.trials)} trials: trial {best.number}, {metric} = {best.value:.6g} "
            f"({study.direction.name.lower()})\n# " + ", ".join(f"{k}={v}" for k, v in best.params.items()) +
            f"\n# its run: {best.user_attrs['run_dir']}\n# train it: vitflow train --config {path} (a longer budget: "
            "train.total_steps=N or train.time_budget=T)\n")
    tmp = _tmp(path)
    tmp.write_text(head + yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)
    return path


def summary(study, sweep_dir: Path, metric: str, direction: str) -> dict[str, Any]:
    """The sweep's result: counts of the trials that count (``trials``, ``complete``, ``pruned``,
    ``failed``), ``best`` (trial, value, params, run_dir) and the files."""
    ended = [t for t in study.get_trials(deepcopy=False) if counted(t)]
    by = {s: sum(t.state.name == s for t in ended) for s in ("COMPLETE", "PRUNED", "FAIL")}
    best = best_trial(study)
    return {"sweep_dir": str(sweep_dir), "metric": metric, "direction": direction, "trials": len(ended),
            "complete": by["COMPLETE"], "pruned": by["PRUNED"], "failed": by["FAIL"],
            "table": str(sweep_dir / TABLE), "best_config": str(sweep_dir / BEST) if best else None,
            "best": {"trial": best.number, "value": best.value, "params": best.params,
                     "run_dir": best.user_attrs["run_dir"]} if best else None}
