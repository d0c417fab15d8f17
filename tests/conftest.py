"""Shared fixtures (the helpers they use are in ``helpers.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One fp32 GEMM for the suite's process and every child it starts (helpers.ENV copies os.environ):
# auto's timing, made in each process on busy cores, can choose differently in two runs that a test
# compares bit for bit (vitflow.models.kernels.onednn).
os.environ.setdefault("VITFLOW_FP32_GEMM", "onednn")
# No cache of choices made by timing between the suite's processes (~/.cache/vitflow/choices.json): tests of
# attention=auto and cpu_bf16_matmul=auto see their timing; the cache's own tests set VITFLOW_CHOICES_CACHE.
os.environ.setdefault("VITFLOW_CHOICES_CACHE", "off")

import torch  # noqa: E402

from helpers import make_folder  # noqa: E402

_DEFAULT_THREADS = torch.get_num_threads()  # before any test sets it


@pytest.fixture(autouse=True)
def _logging_as_new():
    """Each test starts with logging as a new process has it: nothing disabled, vitflow's loggers at
    their default level and propagating, the root at WARNING (an earlier test's library or in-process
    command must not hide the records a test's caplog looks for)."""
    import logging

    logging.disable(logging.NOTSET)
    logging.root.setLevel(logging.WARNING)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("vitflow") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.NOTSET)
            logger.propagate = True


@pytest.fixture(autouse=True)
def _threads_as_new():
    """Each test starts with torch's intra-op thread count as a new process has it: an in-process
    ``vitflow bench ... --threads 1`` sets it for the process, and a later test's timing-choice
    fingerprint (:func:`vitflow.timing.machine_fingerprint`) or rounding would differ from its
    ``python -m vitflow`` children's."""
    if torch.get_num_threads() != _DEFAULT_THREADS:
        torch.set_num_threads(_DEFAULT_THREADS)


@pytest.fixture(autouse=True)
def _roomy_signal_stack():
    """Before each test, a 256 KiB alternate signal stack for the main thread in place of a smaller
    one: a library an earlier test loads (among test_bench_infer's peers) leaves a 20 KiB one, and
    on a CPU with AMX a SIGCHLD delivered on it (PyTorch's DataLoader installs a handler) then
    killed pytest with SIGSEGV (exit 139) in a later test (:func:`vitflow.runtime.ensure_signal_stack`)."""
    from vitflow.runtime import ensure_signal_stack

    ensure_signal_stack()


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "imgs")


@pytest.fixture
def torch_fp32_gemm():
    """fp32 linear layers on PyTorch's GEMM, timm's and Hugging Face's, for the tests that compare a
    vitflow model with theirs at fp32 rounding: the model's math, not two GEMMs' summation orders
    (oneDNN's is tested against float64 in ``models/test_onednn.py``)."""
    from vitflow.models.kernels import onednn

    with onednn.forced("torch"):
        yield


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


from servers import _moto_endpoint, http_server, quick_retries, s3_server  # noqa: E402,F401  real HTTP / S3 servers on 127.0.0.1
