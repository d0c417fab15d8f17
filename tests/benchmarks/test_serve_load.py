"""``benchmarks/serving/serve_load.py``'s yardstick: the model's own batch / batch-1 ratio on the
serving backend, the ceiling the server's batching gain is judged against."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "benchmarks" / "serving" / "serve_load.py")
    module = sys.modules["serve_load"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def test_model_ratio_is_the_models_own_batching_gain(tiny_run):
    pytest.importorskip("aiohttp")
    run, _ = tiny_run
    args = argparse.Namespace(source=str(run), backend="eager_fp32", threads=1, max_batch=8)
    clock = _load().ModelClock(args)
    rounds = [clock.round(seconds=0.4, slices=2) for _ in range(3)]
    own = clock.summary()
    # images/s at batch 8 times one batch-1 call's seconds: how many times faster per image a full batch is
    assert own["model_ratio"] == pytest.approx(own["model_batch_ips"] * own["model_b1_ms"] / 1e3, rel=0.02)
    assert 0.5 < own["model_ratio"] < 8 * 1.5 and own["model_b1_ms"] > 0
    assert own["model_ratio"] == sorted(r["model_ratio"] for r in rounds)[1]  # the median of the rounds
