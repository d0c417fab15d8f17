"""The race of a planned run (``train.race``): candidate models, each planned for this data and
machine, trained inside the run's ``train.time_budget`` and halved by their top-1 on the validation
split (successive halving, Jamieson & Talwalkar 2016: every candidate trains a rung, the better
half trains another, until one is left); the winner continues from its weights, optimizer and
data position to the end of the budget, so none of its work is thrown away.

Each candidate is a run folder of its own under ``RUN/race/NAME`` whose schedule is fitted, from
the start, to the time the winner will have: a rung pauses it (a checkpoint, as a pre-emption
does) and the next resumes it, exactly as ``vitflow resume`` would. The winner's folder becomes
the run folder; ``RUN/race/race.json`` records what each reached and why the winner won. At
every rung the candidates are compared on the same images (:func:`~vitflow.metrics.intervals.
paired_difference`): one ranks above a cheaper one (more images a second) only where the 95%
interval of their difference excludes zero, so a difference within the noise of the validation
split keeps the cheaper (the plan's own model is the cheapest), and the log says so. What the
losers train is :data:`~vitflow.training.plan.rivals.RACE_SHARE` of the budget; the start-ups,
the candidates' step timing and the rung evaluations count against the budget too (the winner's
continuation gets what is left).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vitflow.config import Config, parse_duration
from vitflow.data import eval_loader
from vitflow.evaluation import evaluate
from vitflow.metrics.intervals import paired_difference, wilson
from vitflow.rundir import RACE
from vitflow.training.callbacks import Callback, LiveReport, StepOutput
from vitflow.training.checks import race_names
from vitflow.training.loop import Trainer
from vitflow.training.normalize import shared_datasets
from vitflow.training.plan.rivals import halving, rung_seconds
from vitflow.training.run.folder import check_new_run, run_dir_for

log = logging.getLogger(__name__)

RACE_DIR = Path(RACE).parent.name  # RUN/race/NAME: the candidates' run folders


@dataclass
class Entrant:
    """One candidate: its model ``name``, planned config ``cfg`` and run ``folder``; what it has
    trained (``seconds``, ``steps``, ``images``) and its latest validation ``hits`` (``bool (n,)``)."""

    name: str
    cfg: Config
    folder: Path
    seconds: float = 0.0
    steps: int = 0
    images: int = 0
    hits: np.ndarray | None = None
    rungs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def top1(self) -> float:
        return float(self.hits.mean()) if self.hits is not None and self.hits.size else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds else 0.0


class RaceInterrupted(Exception):
    """A signal stopped a candidate's rung (SIGTERM, SIGINT ...): the race ends with that run's summary."""

    def __init__(self, summary: dict[str, Any]):
        super().__init__(summary["interrupted"])
        self.summary = summary


class RungEnd(Callback):
    """Pauses a candidate's run after ``seconds`` of training: a checkpoint, no final evaluation."""

    def __init__(self, seconds: float, reason: str):
        self.seconds, self.reason = seconds, reason

    def on_step_end(self, trainer, out: StepOutput) -> None:
        if time.perf_counter() - trainer.started >= self.seconds:
            trainer.request_stop(self.reason, interrupt=True)


def held_out_hits(trainer: Trainer) -> np.ndarray:
    """Whether the trained weights (the EMA's where the run keeps one) get each readable image of
    the run's validation split right (``bool (n,)``, in the split's order)."""
    model = trainer.ema.module if trainer.ema is not None else trainer.model
    ev = trainer.evaluator
    loader = eval_loader(trainer.data.val, trainer.data.preprocess, ev.batch_size, ev.num_workers)
    hits: list[torch.Tensor] = []
    evaluate(model, loader, trainer.device, trainer.precision, trainer.data.preprocess, ev.skips, hits=hits,
             num_classes=len(trainer.data.classes))
    return torch.cat(hits).numpy()


def _rung(e: Entrant, k: int, seconds: float, winner_s: float) -> None:
    """Train ``e`` for ``seconds`` more (rung ``k``) with a schedule fitted to ``winner_s`` seconds
    in all, then score it on the validation split."""
    c = copy.deepcopy(e.cfg)
    c.train.run_dir, c.train.resume = str(e.folder), "auto" if e.steps else "none"
    c.train.time_budget = f"{max(winner_s - e.seconds, seconds):.0f}s"
    trainer = Trainer(c, [RungEnd(seconds, f"race: rung {k + 1} done")])
    summary = trainer.fit()
    if str(summary.get("interrupted", "")).startswith("SIG"):  # pre-empted, not paused by the rung
        raise RaceInterrupted(summary)
    steps = summary["step"] - e.steps
    e.seconds += summary["elapsed_s"]
    e.images += steps * c.train.batch_size
    e.steps = summary["step"]
    e.hits = held_out_hits(trainer)
    low, high = wilson(int(e.hits.sum()), e.hits.size)
    e.rungs.append({"rung": k + 1, "seconds": round(e.seconds, 1), "steps": e.steps, "top1": e.top1,
                    "top1_ci95": [low, high]})
    log.info("race: rung %d: %s  val top-1 %.2f%% [%.1f-%.1f] after %d steps (%.0f s, %.0f img/s)", k + 1, e.name,
             100 * e.top1, 100 * low, 100 * high, e.steps, e.seconds, e.images_per_s)


def _halve(alive: list[Entrant], counts: list[int], rung: float, winner_s: float) -> list[Entrant]:
    """Successive halving: each rung trains the candidates still in (``rung`` seconds each), then
    the best ``counts[k + 1]`` go on; returns the last rung's, best first. A candidate whose rung
    raises ValueError or RuntimeError (a diverged loss, too little memory) is dropped, said and
    recorded.

    Raises:
        RuntimeError: every candidate failed.
    """
    for k in range(len(counts)):
        for e in list(alive):
            try:
                _rung(e, k, rung, winner_s)
            except (ValueError, RuntimeError) as err:
                log.warning("race: %s dropped in rung %d: %s", e.name, k + 1, str(err).splitlines()[0])
                e.rungs.append({"rung": k + 1, "error": str(err).splitlines()[0]})
                alive.remove(e)
        if not alive:
            raise RuntimeError("race: every candidate failed (see the warnings above); train.race=none trains the "
                               "plan's model alone")
        alive = rank(alive)
        if k + 1 < len(counts):
            alive = alive[:counts[k + 1]]
    return alive


def separated(a: Entrant, b: Entrant) -> bool:
    """Whether ``a``'s validation top-1 is above ``b``'s beyond the 95% interval of their paired
    difference (:func:`~vitflow.metrics.intervals.paired_difference`); where they scored other
    images (planned to other input sizes), beyond both Wilson intervals."""
    if a.hits.shape != b.hits.shape:
        return wilson(int(a.hits.sum()), a.hits.size)[0] > wilson(int(b.hits.sum()), b.hits.size)[1]
    return paired_difference(a.hits, b.hits)[1][0] > 0


def rank(entrants: list[Entrant]) -> list[Entrant]:
    """``entrants`` best first: by validation top-1, except that a costlier candidate stays above a
    cheaper one (more images a second) only where :func:`separated` says it is better: a
    difference the interval cannot tell from noise keeps the cheaper (the plan's own model, at
    the front of the race, is the cheapest)."""
    order = sorted(entrants, key=lambda e: (-e.top1, -e.images_per_s))
    swapped = True
    while swapped:  # each swap lifts a cheaper candidate over a costlier one: it ends
        swapped = False
        for i in range(len(order) - 1):
            a, b = order[i], order[i + 1]
            if b.images_per_s > a.images_per_s and not separated(a, b):
                order[i], order[i + 1], swapped = b, a, True
    return order


def verdict(first: Entrant, second: Entrant) -> str:
    """Why ``first`` ranks above ``second`` (:func:`rank`), with their paired difference."""
    if first.hits.shape != second.hits.shape:
        shown = f"{100 * first.top1:.1f}% against {100 * second.top1:.1f}% (on {first.hits.size} and {second.hits.size} images)"
    else:
        diff, (low, high) = paired_difference(first.hits, second.hits)
        shown = f"{100 * diff:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}] on the same {first.hits.size} images"
    if separated(first, second):
        return f"{first.name} leads {second.name} by {shown}"
    return (f"{first.name} vs {second.name}: {shown}, which the interval cannot separate: the cheaper "
            f"{first.name} ({first.images_per_s:.0f} img/s against {second.images_per_s:.0f}) is kept")


def race(cfg: Config) -> tuple[Config, dict[str, Any]]:
    """Run ``cfg``'s race; returns the winner's config continuing in the run folder for what is
    left of the budget, and the race's record (also ``RUN/race/race.json``).

    Raises:
        RunDirError: the run folder is taken (checked before any training).
        RaceInterrupted: a signal stopped a rung (its run's summary: continue it with ``vitflow resume``).
        RuntimeError: every candidate failed (:func:`_halve`).
        as :func:`~vitflow.training.plan.recipe.planned_config`, for a candidate the plan cannot build.
    """
    started, budget = time.perf_counter(), parse_duration(cfg.train.time_budget)
    run_dir = run_dir_for(cfg.train, cfg.preset, None)
    check_new_run(run_dir, "none")
    names = race_names(cfg.train.race)
    counts, rung = halving(len(names)), rung_seconds(budget, len(names))
    winner_s = budget - (sum(counts) - len(counts)) * rung
    log.info("race: %s, %.0f s of training each a rung (%s candidates a rung), judged on the validation split",
             ", ".join(names), rung, " -> ".join(map(str, counts)))
    entrants = [Entrant(n, cfg if n == cfg.model.name else cfg.plan_candidate(n), run_dir / RACE_DIR / n)
                for n in names]
    alive = _halve(list(entrants), counts, rung, winner_s)
    winner, why = alive[0], verdict(alive[0], alive[1]) if len(alive) > 1 else "the only candidate left"
    log.info("race: %s wins: %s", winner.name, why)
    spent = round(time.perf_counter() - started, 1)  # as recorded: the budget left is the record's
    record = {"candidates": {e.name: e.rungs for e in entrants}, "winner": winner.name,
              "why": why, "race_s": spent, "budget_s": budget,  # each one's planned step, all costs in (s)
              "planned_step_s": {e.name: getattr(e.cfg, "planned_step_s", None) for e in entrants}}
    (run_dir / RACE).write_text(json.dumps(record, indent=1))
    _adopt(winner.folder, run_dir)
    out = copy.deepcopy(winner.cfg)
    out.train.run_dir, out.train.resume = str(run_dir), "auto"
    out.train.time_budget = f"{max(1.0, budget - spent):.0f}s"
    return out, record


def _adopt(folder: Path, run_dir: Path) -> None:
    """Move the winner's run ``folder`` (``RUN/race/NAME``) up into ``run_dir``: the run continues
    there, its records and checkpoints whole."""
    for entry in folder.iterdir():
        shutil.move(str(entry), run_dir / entry.name)
    folder.rmdir()


def train(cfg: Config, on_eval: Callable[[Path], Any] | None = None, callbacks: Sequence[Callback] = ()
          ) -> dict[str, Any]:
    """Build a :class:`~vitflow.training.loop.Trainer` for ``cfg`` and run it, after ``cfg``'s race
    when it has one (a planned run's ``train.race``); returns :meth:`Trainer.fit`'s summary (with
    the race's record under ``race``). ``on_eval(run_dir)`` runs on rank 0 after every evaluation
    (the CLI's live report); ``callbacks``: user :class:`~vitflow.training.callbacks.Callback` objects."""
    callbacks = ([LiveReport(on_eval)] if on_eval else []) + list(callbacks)
    if cfg.train.race == "none" or cfg.train.resume != "none" or not hasattr(cfg, "plan_candidate"):
        return Trainer(cfg, callbacks).fit()
    with shared_datasets():  # the candidates and the winner's continuation decode the images once
        try:
            cfg, record = race(cfg)
        except RaceInterrupted as e:  # the CLI says how the candidate's run continues
            return e.summary
        summary = Trainer(cfg, callbacks).fit()
    return {**summary, "race": record}
