"""What a run directory holds, by name, and the readers of its records.

A training run writes (see :mod:`vitflow.train.logging` and :mod:`vitflow.checkpoint`)::

    RUN_DIR/run.json               vitflow's mark: this folder belongs to one run
    RUN_DIR/config.yaml            the resolved configuration of the latest start
    RUN_DIR/metrics.jsonl          every metrics record, one JSON object per line
    RUN_DIR/metrics_train.csv      the ``train`` records as CSV
    RUN_DIR/metrics_eval.csv       the ``eval`` records as CSV
    RUN_DIR/eval.json              the latest evaluation (confusion matrix, per-class top-1)
    RUN_DIR/checkpoints/step-XXXXXXXX.pt
    RUN_DIR/tb/                    TensorBoard events (optional)
    RUN_DIR/samples/               a few held-out images, when the test split has no files
"""

from __future__ import annotations

import json
from pathlib import Path

RUN = "run.json"
CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CSV = {"train": "metrics_train.csv", "eval": "metrics_eval.csv"}  # the CSV copy of these record kinds
EVAL = "eval.json"


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
