"""Two plans a run follows over its steps: progressive resizing (the training resolution of each
step) and a wall-clock time budget (the schedule's length fitted to the time left), the latter
applied by a callback (:class:`BudgetStop`)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from vitflow.config import OptimConfig
from vitflow.data.augment import progressive_resolution
from vitflow.training.callbacks import Callback, StepOutput
from vitflow.training.optim.schedules import set_total_steps, warn_long_warmup
from vitflow.training.scale.distributed import DistEnv

log = logging.getLogger(__name__)


class ProgressiveResizing:
    """The training resolution of each step (FFCV's and fast.ai's progressive resizing; see
    :func:`vitflow.data.augment.crops.progressive_resolution`), or ``None`` throughout when off
    (``min_size`` is ``None``). Evaluation always runs at full size.

    Args:
        min_size: the first steps' resolution in pixels.
        full_size: the model's resolution in pixels, reached at ``ramp[1]`` of the run.
        ramp: fractions of the run over which the resolution rises.
        patch_size, prefix_tokens: the model's, for rounding and token counts.
    """

    def __init__(self, min_size: int | None, full_size: int, ramp: tuple[float, float], patch_size: int,
                 prefix_tokens: int):
        self.min_size, self.full_size, self.ramp = min_size, full_size, tuple(ramp)
        self.patch_size, self.prefix_tokens = patch_size, prefix_tokens

    @property
    def enabled(self) -> bool:
        return self.min_size is not None

    def resolution(self, step: int, total: int) -> int | None:
        """Pixels of step ``step`` of ``total``; ``None`` when off."""
        if self.min_size is None:
            return None
        return progressive_resolution(step, total, self.min_size, self.full_size, self.ramp, self.patch_size)

    def step_cost(self, step: int, total: int) -> float:
        """Compute of ``step`` relative to a full-resolution step, by tokens per image."""
        r = self.resolution(step, total)
        if r is None:
            return 1.0
        p, prefix = self.patch_size, self.prefix_tokens
        return ((r // p) ** 2 + prefix) / ((self.full_size // p) ** 2 + prefix)


class TimeBudget:
    """``train.time_budget``: end the run cleanly (final evaluation and checkpoint) within
    ``seconds`` of ``started`` by fitting the schedule's length to the time left.

    The cost of a full-resolution step is measured as the run goes (the first step, with its
    warm-up and allocations, is not timed); :meth:`fit` keeps time for the final evaluation(s)
    and the checkpoint (``min(5 s, 5% of the budget)``) and follows the resizing plan's step costs.

    Args:
        seconds: the budget.
        started: ``time.perf_counter()`` at the start of the run.
        resizing: the run's :class:`ProgressiveResizing` (step costs).
        optim: the run's optimizer config (the warmup check of a fitted schedule).
        final_evals: evaluations at the end (2 with an EMA: the trained and the averaged weights).
    """

    def __init__(self, seconds: float, started: float, resizing: ProgressiveResizing, optim: OptimConfig,
                 final_evals: int = 1):
        self.seconds, self.started, self.resizing, self.final_evals = seconds, started, resizing, final_evals
        self.optim = optim
        self.first_step_at: float | None = None
        self.cost = 0.0  # full-resolution step units since the first step
        self.eval_seconds: float | None = None
        self.probe_seconds = 0.0
        self.warned_warmup = False  # the long-warmup warning is said once, not at every refit

    def step_done(self, cost: float) -> None:
        """Record a finished step of ``cost`` units (its :meth:`ProgressiveResizing.step_cost`)."""
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
        else:
            self.cost += cost

    def over(self) -> bool:
        return time.perf_counter() - self.started > self.seconds

    def measure_eval(self, time_eval: Callable[[], float]) -> None:
        """Time one final evaluation once (``time_eval()`` returns its estimated seconds)."""
        if self.eval_seconds is None:
            probe = time.perf_counter()
            self.eval_seconds = time_eval()
            self.probe_seconds = time.perf_counter() - probe

    def fit(self, step: int, max_total: int) -> int | None:
        """The most total steps (at most ``max_total``) that end within the budget from ``step``;
        ``None`` before any step was timed."""
        if self.first_step_at is None or self.cost <= 0 or self.eval_seconds is None:
            return None
        now = time.perf_counter()
        per_unit = (now - self.first_step_at - self.probe_seconds) / max(self.cost, 1e-9)
        remaining = (self.seconds - (now - self.started) - self.final_evals * self.eval_seconds
                     - min(5.0, 0.05 * self.seconds))

        def fits(total: int) -> bool:
            return sum(self.resizing.step_cost(s, total) for s in range(step, total)) * per_unit <= remaining

        lo, hi = step + 1, max_total
        if not self.resizing.enabled:  # every step costs one unit
            return min(hi, max(lo, step + int(remaining / per_unit)))
        if fits(hi):
            return hi
        while lo < hi:  # the largest total that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def refit(self, scheduler, step: int, max_total: int, dist: DistEnv, time_eval: Callable[[], float]) -> None:
        """Set ``scheduler``'s length (:func:`~vitflow.training.optim.schedules.set_total_steps`) to
        :meth:`fit`'s when it moves by more than 1%. Rank 0 decides for all ranks; every rank
        times the evaluation (``time_eval``: FSDP forwards are collective)."""
        self.measure_eval(time_eval)
        fit = dist.broadcast(self.fit(step, max_total) if dist.is_main else None)
        total = scheduler.lr_lambdas[0].total_steps
        if fit is not None and abs(fit - total) > 0.01 * total:
            set_total_steps(scheduler, fit)
            log.info("time budget: schedule set to %d steps", fit)
            if dist.is_main and not self.warned_warmup:
                self.warned_warmup = warn_long_warmup(self.optim, fit, "the time budget's fitted schedule")


class BudgetStop(Callback):
    """``train.time_budget`` as a callback: times each step into a :class:`TimeBudget`, refits the
    schedule's length every ``log_every`` taken steps, and asks the run to stop (final evaluation
    and checkpoint included) once the budget is spent.

    Args:
        seconds: the budget; ``text``: as the user wrote it (for the log line); ``log_every``:
            ``train.log_every``; ``max_total``: ``train.total_steps`` (the schedule never grows past it).
    """

    def __init__(self, seconds: float, text: str, log_every: int, max_total: int):
        self.seconds, self.text, self.log_every, self.max_total = seconds, text, log_every, max_total
        self.budget: TimeBudget | None = None

    def on_fit_start(self, trainer) -> None:
        self.budget = TimeBudget(self.seconds, trainer.started, trainer.resizing, trainer.cfg.optim,
                                 2 if trainer.ema else 1)

    def on_step_end(self, trainer, out: StepOutput) -> None:
        self.budget.step_done(out.cost)
        if out.taken and out.step % self.log_every == 0 and self.budget.cost > 0:
            self.budget.refit(trainer.scheduler, out.step, self.max_total, trainer.dist,
                              lambda: trainer.evaluator.seconds(trainer.model))
        if self.budget.over():
            trainer.request_stop(f"time budget {self.text} reached at step {trainer.step}")
