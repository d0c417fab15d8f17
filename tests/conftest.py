"""Shared fixtures (the helpers they use are in ``helpers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import make_folder


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "imgs")


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """One short real training run of the default preset through the CLI, shared by tests:
    ``(run_dir, final JSON summary, the finished process)``."""
    import json
    import subprocess
    import sys

    run = tmp_path_factory.mktemp("digits") / "run"
    out = subprocess.run([sys.executable, "-m", "vitflow", "train", "--json", "train.total_steps=400",
                          "train.eval_every=200", "train.log_every=25", f"train.run_dir={run}"],
                         capture_output=True, text=True, check=True)
    return run, json.loads(out.stdout.strip().splitlines()[-1]), out


from servers import http_server, quick_retries, s3_server, _moto_endpoint  # noqa: E402,F401  real HTTP / S3 servers on 127.0.0.1
