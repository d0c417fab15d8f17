"""Pre-emption: a scheduler's warning signal turns into a checkpoint at the next step boundary.

Signals: ``SIGTERM`` (Slurm at the time limit, ``scancel``, Kubernetes, torchrun's agent when it
shuts its workers down), ``SIGINT`` (Ctrl-C) and ``SIGUSR1`` (Slurm's ``--signal=USR1@120``
warning before the time limit). The handler only records the signal; the run's
:class:`Preemption` callback asks the loop to stop after the step, the loop asks every rank at
each step boundary whether any rank wants to stop (one all-reduce, so all ranks stop after the
same step), writes the checkpoint on all ranks, logs one line and returns; ``vitflow
train`` then exits with :func:`exit_code` ``= 128 + signal number`` (SIGTERM 143, SIGINT 130,
SIGUSR1 138). On ``SIGUSR1`` in a Slurm job, rank 0 also requeues the job after the checkpoint
(``scontrol requeue $SLURM_JOB_ID``; the job needs ``--requeue``), and the requeued job
continues from that checkpoint (:mod:`vitflow.training.scale.elastic`).

In a plain process a second SIGTERM / SIGINT acts as usual (stops at once); a process started by
torchrun or srun ignores repeats (the scheduler and the agent both deliver the signal; the
launcher itself kills the process after its grace period if needed).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from typing import Mapping

from vitflow.training.callbacks import Callback, StepOutput
from vitflow.training.run.guards import StopSignals
from vitflow.training.scale.elastic import launched_by_srun

log = logging.getLogger(__name__)


def exit_code(name: str) -> int:
    """The exit status of a run stopped by signal ``name`` (``"SIGTERM"``): 128 + its number."""
    return 128 + int(signal.Signals[name])


def launched(environ: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun's agent, srun) started this process and owns its shutdown."""
    return "TORCHELASTIC_RUN_ID" in environ or launched_by_srun(environ)


class Preemption(StopSignals, Callback):
    """:class:`~vitflow.training.run.guards.StopSignals` for SIGTERM, SIGINT and SIGUSR1 (see the module
    docstring): while active, the first signal is recorded in :attr:`signum`; repeats are ignored
    under a launcher and for SIGUSR1, else act as usual. As a callback it is active from the first
    step to the end of the loop, and turns a recorded signal into an interruption of the run after
    the step (a checkpoint, no final evaluation)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.launched = launched(os.environ if environ is None else environ)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a repeat: a launcher's copy, or a user insisting
            if not self.launched and signum != signal.SIGUSR1:
                signal.signal(signum, self._previous[signum])
                signal.raise_signal(signum)  # acts as usual: SIGINT raises KeyboardInterrupt, SIGTERM kills
            return
        self.signum = signum
        log.warning("received %s: writing a checkpoint after this step on every rank, then exiting%s",
                    signal.Signals(signum).name, "" if self.launched else " (send it again to stop immediately)")

    def on_fit_start(self, trainer) -> None:
        self.__enter__()

    def on_step_end(self, trainer, out: StepOutput) -> None:
        if self.signum is not None:
            trainer.request_stop(self.name, interrupt=True)

    def on_train_end(self, trainer) -> None:
        self.__exit__()


def after_checkpoint(name: str | None, is_main: bool, environ: Mapping[str, str] | None = None) -> bool:
    """After the pre-emption checkpoint: on SIGUSR1 in a Slurm job, rank 0 (``is_main``) runs
    ``scontrol requeue SLURM_JOB_ID``; returns True when the job was requeued. A failed requeue
    (no scontrol, a job without ``--requeue``) is logged and training's result stands."""
    environ = os.environ if environ is None else environ
    if name != "SIGUSR1" or not is_main or "SLURM_JOB_ID" not in environ:
        return False
    job, exe = environ["SLURM_JOB_ID"], shutil.which("scontrol", path=environ.get("PATH"))
    if exe is None:
        log.warning("SIGUSR1 in Slurm job %s: scontrol not found, the job is not requeued", job)
        return False
    out = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        log.warning("scontrol requeue %s failed (%s); submit with --requeue", job, out.stderr.strip()[-300:])
        return False
    log.warning("requeued Slurm job %s: it continues from this checkpoint", job)
    return True


def interrupted_end(trainer) -> dict:
    """The end of a run a signal interrupted (a :class:`~vitflow.training.loop.Trainer` whose loop has
    stopped): a checkpoint, the ``interrupted`` record and one line saying how to continue, then the
    Slurm requeue on SIGUSR1. Returns the summary: ``interrupted`` (the signal's name), ``step``,
    ``run_dir``, ``checkpoint``, ``elapsed_s``."""
    path = trainer.save()
    trainer.epochs.end_partial(trainer.step)  # the part of the epoch it stopped in, recorded after the checkpoint
    summary = {"interrupted": trainer.interrupted, "step": trainer.step, "run_dir": str(trainer.run_dir),
               "checkpoint": str(path), "elapsed_s": time.perf_counter() - trainer.started}
    trainer.metrics.write("interrupted", **summary)
    said = log.warning if trainer.interrupted.startswith("SIG") else log.debug  # a signal, or a pause (a race's rung)
    said("%s: checkpoint %s written at step %d; continue with: vitflow resume %s", trainer.interrupted, path,
         trainer.step, trainer.run_dir)
    after_checkpoint(trainer.interrupted, trainer.dist.is_main)  # SIGUSR1 under Slurm: requeue the job
    return summary
