"""Run metrics: one JSON object per line in ``RUN_DIR/metrics.jsonl``, flushed per record."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends records ``{"time": unix seconds, "kind": ..., ...}`` to a JSONL file; a resumed
    run appends to the same file. Non-finite floats are written as ``null``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, kind: str, **values: Any) -> dict:
        rec = {"time": round(time.time(), 3), "kind": kind, **{k: _clean(v) for k, v in values.items()}}
        self._f.write(json.dumps(rec) + "\n")
        return rec

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    return v
