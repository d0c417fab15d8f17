"""What a run directory holds, by name, and the readers of its records.

A training run writes (see :mod:`vitflow.training.track.records` and :mod:`vitflow.checkpoint`)::

    RUN_DIR/run.json               vitflow's mark: this folder belongs to one run
    RUN_DIR/config.yaml            the resolved configuration of the latest start
    RUN_DIR/metrics.jsonl          every metrics record, one JSON object per line
    RUN_DIR/metrics_train.csv      the ``train`` records as CSV
    RUN_DIR/metrics_eval.csv       the ``eval`` records as CSV
    RUN_DIR/eval.json              the latest evaluation (confusion matrix, per-class top-1)
    RUN_DIR/checkpoints/step-XXXXXXXX.pt
    RUN_DIR/checkpoints/best.pt    the best checkpoint by ``train.keep_best``
    RUN_DIR/tb/                    TensorBoard events (optional)
    RUN_DIR/samples/               a few held-out images, one per class (up to 10)
    RUN_DIR/evals/                 ``vitflow eval`` results of the run's checkpoints (one JSON each)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RUN = "run.json"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CSV = {"train": "metrics_train.csv", "eval": "metrics_eval.csv"}  # the CSV copy of these record kinds
EVAL = "eval.json"
EVALS = "evals"  # vitflow eval's results of this run's checkpoints
SAMPLES = "samples"
CHECKPOINTS = "checkpoints"
BEST = "best.pt"
RACE = "race/race.json"  # a planned run's race: what each candidate reached, the winner and why
STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")  # a complete checkpoint of a step


def is_run_dir(path: str | Path) -> bool:
    """True for a folder vitflow created for a run (it holds ``run.json``)."""
    return (Path(path) / RUN).is_file()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file (``path``), or of ``RUN_DIR/metrics.jsonl`` when
    ``path`` is a run directory, in the order written.

    Raises:
        FileNotFoundError: no such file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint a run directory ``path`` stands for as a source of weights: its best one
    (``checkpoints/best.pt``), else its newest complete ``step-XXXXXXXX.pt``; ``None`` when
    ``path`` holds no ``checkpoints`` folder with one."""
    folder = Path(path) / CHECKPOINTS
    if not folder.is_dir():
        return None
    if (folder / BEST).is_file():
        return folder / BEST
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE.match(p.name)))
    return steps[-1][1] if steps else None


def run_of_checkpoint(checkpoint: str | Path) -> Path | None:
    """The run directory a checkpoint file lies in (``RUN/checkpoints/NAME.pt``), or ``None``."""
    run = Path(checkpoint).parent.parent
    return run if Path(checkpoint).parent.name == CHECKPOINTS and is_run_dir(run) else None


def write_eval_record(run: str | Path, record: dict) -> Path:
    """Keep a ``vitflow eval`` result of one of the run's checkpoints as
    ``RUN/evals/step-XXXXXXXX-SPLIT.json`` (replaced atomically; the same checkpoint and split
    evaluated again replaces it), where the run report finds it. ``record`` holds ``step`` and
    ``split`` and the figures as ``eval.json`` holds them. Returns the path."""
    folder = Path(run) / EVALS
    folder.mkdir(exist_ok=True)
    path = folder / f"step-{int(record['step']):08d}-{record['split']}.json"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return path


def read_eval_records(run: str | Path) -> list[dict]:
    """The ``vitflow eval`` results kept in ``RUN/evals`` (:func:`write_eval_record`), oldest step
    first; unreadable files are left out."""
    out = []
    for p in sorted((Path(run) / EVALS).glob("step-*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: (r.get("step", 0), r.get("time", 0)))
