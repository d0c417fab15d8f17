"""Fixtures of the inference tests."""

from __future__ import annotations

import pytest

from helpers import digits_config


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 60-step run of the default preset (a 4-block ViT on the embedded 8x8 digits, average
    pooling), trained in this process: ``(run_dir, summary)``."""
    from vitflow.train import train

    run = tmp_path_factory.mktemp("tiny") / "run"
    summary = train(digits_config(run, "train.total_steps=60", "train.eval_every=0", "train.log_every=30"))
    return run, summary
