"""Every learning-rate schedule, per optimizer step (the one place for them).

A schedule is a multiplier ``f(s)`` of the peak learning rate ``optim.lr`` at optimizer step
``s`` (0-based: the value used by step ``s``'s own update). It has two phases:

1. linear warmup (Goyal et al. 2017): ``f(s) = (s + 1) / W`` for ``s < W = warmup_steps``;
2. a decay over the remaining ``L = total_steps - W`` steps, with ``t = s - W``:

   ============== =================================================================================
   ``cosine``     ``m + (1 - m) * (1 + cos(pi * t / L)) / 2`` (Loshchilov & Hutter 2017, SGDR without
                  restarts), ``m = min_ratio``
   ``linear``     ``m + (1 - m) * (1 - t / L)``
   ``step``       ``gamma ** (number of milestones <= s)`` (multi-step decay, He et al. 2016);
                  a milestone ``>= 1`` is a step, one in ``(0, 1)`` a fraction of ``total_steps``
   ``restarts``   cosine with warm restarts (SGDR): ``cycles`` cycles fill ``L``, each
                  ``cycle_mult`` times longer than the one before (the first is
                  ``T0 = L (k - 1) / (k ** n - 1)``, or ``L / n`` for ``k = 1``); cycle ``i``
                  starts at peak ``cycle_decay ** i`` and decays to ``m`` times that
   ``constant``   ``1``
   ============== =================================================================================

Steps past ``total_steps`` keep the final value. Every parameter is a function of
``total_steps`` (fractional milestones, the restart cycle lengths), so a schedule fitted to a
time budget (``train.time_budget``) keeps its shape. :class:`Schedule` is a picklable
dataclass: the scheduler's state, and therefore checkpoints, carry it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from vitflow.config import OptimConfig

KINDS = ("cosine", "linear", "step", "restarts", "constant")


@dataclass
class Schedule:
    """The learning-rate multiplier ``f(s)`` described in the module docstring.

    Raises (at construction):
        ValueError: an unknown ``kind`` or out-of-range parameter.
    """

    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_ratio: float = 0.0
    milestones: tuple[float, ...] = (0.5, 0.75)
    gamma: float = 0.1
    cycles: int = 1
    cycle_mult: float = 1.0
    cycle_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; choose one of {KINDS}")
        if self.cycles < 1 or self.cycle_mult < 1:
            raise ValueError(f"restarts need cycles >= 1 and cycle_mult >= 1, got {self.cycles}, {self.cycle_mult}")
        self.milestones = tuple(self.milestones)

    def __call__(self, s: int) -> float:
        if s < self.warmup_steps:
            return (s + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** bisect.bisect_right(self.milestone_steps(), s)
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(s - self.warmup_steps, span)
        peak = 1.0
        if self.kind == "restarts":
            start, length, i = self.cycle_of(t, span)
            t, span, peak = t - start, length, self.cycle_decay ** i
        if self.kind == "linear":
            shape = 1.0 - t / span
        else:  # cosine, and each restart cycle
            shape = 0.5 * (1.0 + math.cos(math.pi * min(t / span, 1.0)))
        return peak * (self.min_ratio + (1.0 - self.min_ratio) * shape)

    def milestone_steps(self) -> list[int]:
        """The multi-step milestones as absolute steps (fractions resolved against ``total_steps``)."""
        return [round(m * self.total_steps) if m < 1 else int(m) for m in self.milestones]

    def cycle_of(self, t: float, span: int) -> tuple[float, float, int]:
        """``(start, length, index)`` of the restart cycle holding decay step ``t`` of ``span``."""
        n, k = self.cycles, self.cycle_mult
        length = span / n if k == 1 else span * (k - 1) / (k**n - 1)
        start, i = 0.0, 0
        while i < n - 1 and t >= start + length:
            start, length, i = start + length, length * k, i + 1
        return start, length, i


def schedule_from_config(cfg: OptimConfig, total_steps: int) -> Schedule:
    """The :class:`Schedule` of an :class:`OptimConfig` for a run of ``total_steps`` steps."""
    return Schedule(total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr / cfg.lr, tuple(cfg.milestones),
                    cfg.gamma, cfg.cycles, cfg.cycle_mult, cfg.cycle_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step :class:`torch.optim.lr_scheduler.LambdaLR` driven by one :class:`Schedule`
    shared by every parameter group (each group's own base lr, e.g. from layer-wise decay, is
    multiplied by it)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_from_config(cfg, total_steps))


def schedule_of(scheduler: torch.optim.lr_scheduler.LambdaLR) -> Schedule:
    """The :class:`Schedule` a scheduler from :func:`build_scheduler` runs (shared by its groups)."""
    return scheduler.lr_lambdas[0]


def set_total_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Stretch or shrink a running schedule to ``total_steps`` (time budget, resumed runs)."""
    for fn in scheduler.lr_lambdas:
        fn.total_steps = total_steps
