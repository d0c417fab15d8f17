"""Callbacks: what a training run does beside its loop, and where user code joins it.

The loop (:class:`vitflow.training.loop.Trainer`) fetches, steps, evaluates and checkpoints; every
side concern is a :class:`Callback` it calls at fixed points: the progress bar and the ``train``
records (:class:`vitflow.training.track.records.ProgressLog`), the time budget
(:class:`vitflow.training.plan.budget.BudgetStop`), pre-emption signals
(:class:`vitflow.training.run.preempt.Preemption`), the best checkpoint and early stopping
(:class:`vitflow.training.track.selection.Selection`), the MLflow / W&B trackers
(:class:`vitflow.training.track.trackers.Trackers`) and the live report (:class:`LiveReport`). A user's
callback is the same kind of object, given to :func:`vitflow.training.race.train` (or
``vitflow.train(..., callbacks=[...])``): the interface follows Lightning's ``Callback`` and
Hugging Face's ``TrainerCallback``, reduced to what a vitflow run has.

Every rank of a distributed run calls its callbacks; ``trainer.dist.is_main`` tells rank 0. A
callback stops the run with :meth:`Trainer.request_stop <vitflow.training.loop.Trainer.request_stop>`:
the loop ends after the current step (all ranks agree), then the final evaluation and checkpoint
run as at the end of the schedule, and the summary says why (``stopped``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer step did, as :meth:`Callback.on_step_end` sees it.

    Attributes:
        step: the trainer's step count after it (taken steps only).
        loss: the loss averaged over the micro-batches and ranks.
        grad_norm: the global gradient L2 norm before clipping.
        images: images this rank trained on in the step.
        data_wait: seconds this rank waited for its batches.
        cost: the step's cost in full-resolution steps (progressive resizing makes early ones cheaper).
        taken: False when the non-finite guard refused the step (no update, ``step`` unchanged).
    """

    step: int
    loss: float
    grad_norm: float
    images: int
    data_wait: float
    cost: float
    taken: bool


class Callback:
    """A training callback: override the hooks you need (each is a no-op here).

    Hooks, in the order a run calls them:

    - :meth:`on_fit_start` once, after the trainer is built (and a resumed state restored),
      before the first step;
    - :meth:`on_step_end` after every optimizer step (also one the non-finite guard refused);
    - :meth:`on_evaluation` after each evaluation of a split (during training and at the end;
      ``trainer.finishing`` is True for the final ones);
    - :meth:`on_checkpoint` after each checkpoint write (rank 0: the path; other ranks: ``None``);
    - :meth:`on_record` for every metrics record the run writes (rank 0);
    - :meth:`on_train_end` when the loop has ended (finished, stopped, interrupted or failed),
      before the final evaluation;
    - :meth:`on_fit_end` last, with the run's summary (``None`` when the run failed).

    A callback with a :attr:`state_key` has its :meth:`state_dict` saved in every checkpoint
    under that key and handed back to :meth:`load_state_dict` on resume, so that a resumed run
    decides as an uninterrupted one would.
    """

    state_key: str | None = None

    def on_fit_start(self, trainer) -> None:
        """The run is about to take its first step."""

    def on_step_end(self, trainer, out: StepOutput) -> None:
        """A step ended (see :class:`StepOutput`)."""

    def on_evaluation(self, trainer, split: str, metrics: dict[str, Any]) -> None:
        """``split`` (``val``, ``test`` or a ``data.evals`` name) was evaluated: ``metrics`` holds its
        figures (``top1``, ``loss``, ... as fractions; see :mod:`vitflow.metrics`) for the weights
        inference uses (the EMA's when there is one)."""

    def on_checkpoint(self, trainer, path: Path | None) -> None:
        """A checkpoint of ``trainer.step`` was written to ``path``."""

    def on_record(self, trainer, record: dict[str, Any]) -> None:
        """A metrics record (``{"time", "kind", ...}``, as in ``metrics.jsonl``) was written."""

    def on_train_end(self, trainer) -> None:
        """The loop ended; the final evaluation (if any) comes next."""

    def on_fit_end(self, trainer, summary: dict[str, Any] | None) -> None:
        """The run is over: ``summary`` as :meth:`~vitflow.training.loop.Trainer.fit` returns it, or
        ``None`` when it failed."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this callback (with :attr:`state_key` set)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (a resumed run)."""


class CallbackList:
    """The run's callbacks, called in order: the built-in ones first, then the user's."""

    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def find(self, kind: type) -> Any:
        """The first callback of class ``kind``, or ``None``."""
        return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)

    def call(self, hook: str, trainer, *args: Any) -> None:
        """Call ``hook`` of every callback that has it (user callbacks may implement a subset)."""
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(trainer, *args)

    def state_dict(self) -> dict[str, Any]:
        """``{state_key: state}`` of the callbacks that keep state."""
        return {cb.state_key: cb.state_dict() for cb in self.callbacks if getattr(cb, "state_key", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand each keeping callback its part of a checkpoint (absent parts: nothing to restore)."""
        for cb in self.callbacks:
            key = getattr(cb, "state_key", None)
            if key and state.get(key) is not None:
                cb.load_state_dict(state[key])


class LiveReport(Callback):
    """Calls ``hook(run_dir)`` on rank 0 at the run's first ``train`` record (a page that says when
    the first evaluation comes) and after evaluations (the CLI's live HTML report,
    ``train.live_report``); a failure of the hook is a warning, never the run's end.

    Drawing the page costs about a second on a CPU (matplotlib), so it is kept to at most ``share``
    of the run's time: after an evaluation the page is rewritten once at least ``1 / share`` times
    the last write's own duration has passed since it (5%: a 1-s page at most every 20 s). A
    15-minute run evaluated every minute rewrites it at every evaluation; a 20-step run evaluated at
    every step no longer spends most of its time drawing. The run's end is the caller's to write (the
    CLI and :func:`vitflow.train` write the final report); an interrupted run's page is brought up to
    date here, in ``on_fit_end``.
    """

    def __init__(self, hook: Callable[[Path], Any], share: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self.hook, self.share, self.clock = hook, share, clock
        self.written, self.stale, self.due = False, False, 0.0

    def on_record(self, trainer, record: dict[str, Any]) -> None:
        if record.get("kind") == "train" and not self.written and trainer.dist.is_main:
            self._write(trainer, "at the first records")

    def on_evaluation(self, trainer, split: str, metrics: dict[str, Any]) -> None:
        if not trainer.dist.is_main or split in trainer.evaluator.named:  # once per evaluation round
            return
        self.stale = True
        if self.clock() >= self.due:
            self._write(trainer, "after the evaluation")

    def on_fit_end(self, trainer, summary: dict[str, Any] | None) -> None:
        if self.stale and trainer.dist.is_main and (summary is None or "interrupted" in summary):
            self._write(trainer, "at the run's end")

    def _write(self, trainer, when: str) -> None:
        self.written, self.stale, start = True, False, self.clock()
        try:
            self.hook(trainer.run_dir)
        except Exception as e:  # noqa: BLE001 - a report must never stop a run
            log.warning("%s at step %d: %s: %s", when, trainer.step, type(e).__name__, e)
        end = self.clock()
        self.due = end + (end - start) / self.share
