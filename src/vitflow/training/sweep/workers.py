"""``vitflow sweep --workers N``: N worker processes on this machine, each a sweep of its own on the
same folder and storage (so they cooperate exactly as N commands would), with the cores split
between them (``train.threads`` = cores // N, at least 1)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from typing import Any, Callable

from vitflow.training.sweep.space import SweepError
from vitflow.training.sweep.trial import SweepInterrupted


def _logging() -> tuple[int, int, logging.Formatter | None]:
    """This process's log levels (root, ``vitflow``) and line format, for the workers to log alike."""
    root = logging.getLogger()
    return root.level, logging.getLogger("vitflow").level, root.handlers[0].formatter if root.handlers else None


def _worker(run: Callable[..., Any], kwargs: dict[str, Any], threads: int, logs: tuple) -> None:
    """A worker process: ``run`` (:func:`~vitflow.training.sweep.search.run_sweep`) as one worker
    on ``threads`` threads, logging as the command does; exit 130 on a signal, 2 on a sweep error
    (its line on stderr)."""
    import torch

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logs[2])
    logging.basicConfig(level=logs[0], handlers=[handler])
    logging.getLogger("vitflow").setLevel(logs[1])
    torch.set_num_threads(threads)
    try:
        run(**kwargs, workers=1, threads=threads)
    except SweepInterrupted as e:
        print(e, file=sys.stderr)
        raise SystemExit(130) from None
    except SweepError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None


def run_workers(n: int, run: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Start ``n`` worker processes running ``run(**kwargs)`` (:func:`run_sweep` and its
    arguments) and wait for them; SIGINT / SIGTERM to this process is passed on to them.

    Raises:
        SweepInterrupted: a worker was stopped by a signal.
        SweepError: a worker ended on an error (its own line above).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // n)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no forked torch or database state
    procs = [ctx.Process(target=_worker, args=(run, kwargs, threads, _logging()), name=f"vitflow-sweep-worker-{i}") for i in range(n)]
    for p in procs:
        p.start()

    def forward(signum, _frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.join()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.exitcode for p in procs]
    if 130 in codes or any(c is not None and c < 0 for c in codes):
        raise SweepInterrupted(f"a signal stopped the workers (exit codes {codes})")
    if any(codes):
        raise SweepError(f"{sum(c != 0 for c in codes)} of {n} workers ended on an error (their lines above)")
