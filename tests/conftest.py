"""Shared fixtures (the helpers they use are in ``helpers.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

# One fp32 GEMM for the suite's process and every child it starts (helpers.ENV copies os.environ):
# auto's timing, made in each process on busy cores, can choose differently in two runs that a test
# compares bit for bit (vitflow.models.kernels.onednn).
os.environ.setdefault("VITFLOW_FP32_GEMM", "onednn")
# No cache of choices made by timing between the suite's processes (~/.cache/vitflow/choices.json): tests of
# attention=auto and cpu_bf16_matmul=auto see their timing; the cache's own tests set VITFLOW_CHOICES_CACHE.
os.environ.setdefault("VITFLOW_CHOICES_CACHE", "off")
# Nothing reaches the internet: a planned run's model.pretrained=auto reads the Hugging Face cache only (the
# tests of the download path start a stand-in hub on 127.0.0.1 and turn this off for themselves).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist each worker (and every process it starts: torch reads OMP_NUM_THREADS) gets its share
# of the cores, at least one thread: two workers of two threads each on two cores spin against each other,
# and a test of torch's GEMMs then ran 2-3x slower than alone.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

import torch  # noqa: E402

from helpers import digits_config, make_folder  # noqa: E402

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


def pytest_collection_modifyitems(config, items) -> None:
    """The files that hold a test marked ``slow`` first, each file's tests together and in order: the
    workers start on the long ones, and the end of the run is short tests, shared out among the
    workers (``--dist worksteal``), instead of one long test running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): one worker a core and one more, at most 4. Many tests wait
    on the processes and servers they start (a kill at a checkpoint, a server's answers), and the
    extra worker fills those waits: on 2 cores 3 workers ran the suite in 0.93x the time of 2 (CPU
    idle 8%); each worker holds a few GB, and more than 4 only repeat the session's shared work."""
    return max(1, min((os.cpu_count() or 1) + 1, 4))


def build_once(tmp_path_factory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(folder)`` run once for the whole test run, however many xdist workers there are: the
    first worker to ask builds into ``folder`` under a file lock and keeps its (JSON) result beside
    it; the others wait for the lock and read that result. Without xdist it is a session fixture's
    body. For what many test files start from (a trained run): trained once, not once a worker."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's own folder, above every worker's
    folder, result = root / f"shared-{name}", root / f"shared-{name}.json"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not result.is_file():
            folder.mkdir(exist_ok=True)
            tmp = result.with_suffix(".tmp")
            tmp.write_text(json.dumps(build(folder)))
            os.replace(tmp, result)
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """One short real training run of the default preset through the CLI, shared by tests (built
    once per test run, :func:`build_once`): ``(run_dir, final JSON summary, the finished process's
    stdout and stderr)``."""
    import subprocess
    import sys

    def build(folder: Path) -> dict:
        run = folder / "run"
        out = subprocess.run([sys.executable, "-m", "vitflow", "train", "--json", "train.total_steps=400",
                              "train.eval_every=200", "train.log_every=25", f"train.run_dir={run}"],
                             capture_output=True, text=True, check=True)
        return {"run": str(run), "summary": json.loads(out.stdout.strip().splitlines()[-1]), "stdout": out.stdout,
                "stderr": out.stderr}

    shared = build_once(tmp_path_factory, "digits-run", build)
    return Path(shared["run"]), shared["summary"], SimpleNamespace(stdout=shared["stdout"], stderr=shared["stderr"])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A 60-step run of the default preset (a 4-block ViT on the embedded 8x8 digits, average
    pooling), shared by tests (built once per test run, :func:`build_once`): ``(run_dir, summary)``."""

    def build(folder: Path) -> dict:
        from vitflow.training import train

        run = folder / "run"
        summary = train(digits_config(run, "train.total_steps=60", "train.eval_every=0", "train.log_every=30"))
        return {"run": str(run), "summary": summary}

    shared = build_once(tmp_path_factory, "tiny-run", build)
    return Path(shared["run"]), shared["summary"]


from servers import _moto_endpoint, http_server, quick_retries, s3_server  # noqa: E402,F401  real HTTP / S3 servers on 127.0.0.1
