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

Steps past ``total_steps`` keep the final value. With ``restart = R > 0`` (LP-FT's switch,
:mod:`vitflow.training.optim.finetune`) the schedule runs twice: over steps ``[0, R)`` as if
``total_steps`` were ``R``, then again from ``R`` (warmup included) over ``[R, total_steps)``.
Every parameter is a function of ``total_steps`` (fractional milestones, the restart cycle
lengths), so a schedule fitted to a time budget (``train.time_budget``) keeps its shape. :class:`Schedule` is a picklable
dataclass: the scheduler's state, and therefore checkpoints, carry it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from vitflow.config import OptimConfig

log = logging.getLogger(__name__)

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
    restart: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; choose one of {KINDS}")
        if self.cycles < 1 or self.cycle_mult < 1:
            raise ValueError(f"restarts need cycles >= 1 and cycle_mult >= 1, got {self.cycles}, {self.cycle_mult}")
        self.milestones = tuple(self.milestones)

    def __call__(self, s: int) -> float:
        if self.restart > 0:  # two runs of the schedule: [0, restart) and [restart, total_steps)
            start, end = (0, self.restart) if s < self.restart else (self.restart, self.total_steps)
            return dataclasses.replace(self, total_steps=max(1, end - start), restart=0)(s - start)
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


def schedule_from_config(cfg: OptimConfig, total_steps: int, restart: int = 0) -> Schedule:
    """The :class:`Schedule` of an :class:`OptimConfig` for a run of ``total_steps`` steps
    (``restart``: see :class:`Schedule`)."""
    return Schedule(total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr / cfg.lr, tuple(cfg.milestones),
                    cfg.gamma, cfg.cycles, cfg.cycle_mult, cfg.cycle_decay, restart)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    restart: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step :class:`torch.optim.lr_scheduler.LambdaLR` driven by one :class:`Schedule`
    shared by every parameter group (each group's own base lr, e.g. from layer-wise decay, is
    multiplied by it); ``restart > 0`` runs the schedule again from that step (LP-FT)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_from_config(cfg, total_steps, restart))


def schedule_of(scheduler: torch.optim.lr_scheduler.LambdaLR) -> Schedule:
    """The :class:`Schedule` a scheduler from :func:`build_scheduler` runs (shared by its groups)."""
    return scheduler.lr_lambdas[0]


def set_total_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Stretch or shrink a running schedule to ``total_steps`` (time budget, resumed runs)."""
    for fn in scheduler.lr_lambdas:
        fn.total_steps = total_steps


@dataclass
class LrCurve:
    """The learning rate of every step of a config's schedule, for plots (``vitflow lr-schedule``).

    Attributes:
        lrs: ``optim.lr`` times the schedule, steps ``0 .. total_steps - 1``.
        warmup_steps: the warmup length.
        lowest_scale: with layer-wise decay, the embeddings' multiplier
            ``layer_decay ** (depth + 1)`` (:func:`vitflow.training.optim.optimizers.param_groups`); else ``None``.
        title: the optimizer, peak lr, warmup and shape in words.
    """

    lrs: list[float]
    warmup_steps: int
    lowest_scale: float | None
    title: str

    def landmarks(self) -> list[tuple[int, float]]:
        """``(step, lr)`` at 0, the end of warmup, 25/50/75 % and the last step."""
        total = len(self.lrs)
        marks = sorted({0, min(self.warmup_steps, total - 1), total // 4, total // 2, 3 * total // 4, total - 1})
        return [(s, self.lrs[s]) for s in marks]


def lr_curve(cfg: OptimConfig, total_steps: int, depth: int, time_budget: str | None = None,
             restart: int = 0) -> LrCurve:
    """The :class:`LrCurve` of ``cfg`` over ``total_steps`` for a model of ``depth`` blocks. A
    ``time_budget`` refits the length at run time: the title says so. ``restart``: LP-FT's switch
    (see :class:`Schedule`), named in the title."""
    fn = schedule_from_config(cfg, total_steps, restart)
    shape = {"step": f"step x{cfg.gamma:g} at {list(fn.milestone_steps())}",
             "restarts": f"restarts: {cfg.cycles} cycles, mult {cfg.cycle_mult:g}, decay {cfg.cycle_decay:g}"}
    title = f"{cfg.name}, peak lr {cfg.lr:g}, warmup {cfg.warmup_steps}, {shape.get(cfg.schedule, cfg.schedule)}"
    if restart:
        title += f", again from step {restart} (LP-FT)"
    if time_budget:
        title += f"\n(train.time_budget={time_budget}: length fitted at run time)"
    lowest = cfg.layer_decay ** (depth + 1) if cfg.layer_decay else None
    return LrCurve([cfg.lr * fn(s) for s in range(total_steps)], cfg.warmup_steps, lowest, title)


def warn_long_warmup(cfg: OptimConfig, total_steps: int, what: str) -> bool:
    """Warn when ``optim.warmup_steps`` is not below the schedule's length ``total_steps`` (named
    ``what``): the run would end inside the warmup. Returns whether it warned."""
    if cfg.warmup_steps < total_steps:
        return False
    log.warning("optim.warmup_steps=%d is not below %s (%d steps): the run ends inside the warmup, at "
                "%.3g of the peak lr %g", cfg.warmup_steps, what, total_steps, total_steps / cfg.warmup_steps, cfg.lr)
    return True
