"""The race of a planned run (``train.race``): candidate models, each planned for this data and
machine, trained inside the run's ``train.time_budget`` and halved by their top-1 on the validation
split (successive halving, Jamieson & Talwalkar 2016: every candidate trains a rung, the better
half trains another, until one is left); the winner continues from its weights, optimizer and
data position to the end of the budget, so none of its work is thrown away.

Each candidate is a run folder of its own under ``RUN/race/NAME`` whose schedule is fitted, from
the start, to the time the winner will have: a rung pauses it (a checkpoint, as a pre-emption
does) and the next resumes it, exactly as ``vitflow resume`` would. The winner's folder becomes
the run folder; ``RUN/race/race.json`` records what each reached and why the winner won. The
last rung's two candidates are compared on the same images (:func:`~vitflow.metrics.intervals.
paired_difference`): the better-scoring one wins only where the 95% interval of the difference
excludes zero; else the one that trained more images a second (the cheaper) is kept, and the log
says so. What the losers trained is at most :data:`~vitflow.training.plan.rules.RACE_SHARE` of the
budget; their start-ups, probes and rung evaluations are counted in it too (the winner's
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
from vitflow.training.loop import Trainer
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


def decide(first: Entrant, second: Entrant) -> tuple[Entrant, str]:
    """The winner of the last rung and why: the higher top-1 when the paired 95% interval of the
    difference excludes zero, else the cheaper (more images a second) of the two."""
    diff, (low, high) = paired_difference(first.hits, second.hits)
    shown = f"{100 * diff:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}] on the same {first.hits.size} images"
    if low > 0:
        return first, f"{first.name} leads {second.name} by {shown}"
    cheaper = max((first, second), key=lambda e: e.images_per_s)
    return cheaper, (f"{first.name} vs {second.name}: {shown}, which the interval cannot separate: the cheaper "
                     f"{cheaper.name} ({cheaper.images_per_s:.0f} img/s) is kept")


def race(cfg: Config) -> tuple[Config, dict[str, Any]]:
    """Run ``cfg``'s race; returns the winner's config continuing in the run folder for what is
    left of the budget, and the race's record (also ``RUN/race/race.json``).

    Raises:
        RunDirError: the run folder is taken (checked before any training).
        as :class:`~vitflow.training.loop.Trainer`, for a candidate the plan cannot build.
    """
    started, budget = time.perf_counter(), parse_duration(cfg.train.time_budget)
    run_dir = run_dir_for(cfg.train, cfg.preset, None)
    check_new_run(run_dir, "none")
    names = [n.strip() for n in cfg.train.race.split(",")]
    counts, rung = halving(len(names)), rung_seconds(budget, len(names))
    winner_s = budget - (sum(counts) - len(counts)) * rung
    log.info("race: %s, %.0f s of training each a rung (%s candidates a rung), judged on the validation split",
             ", ".join(names), rung, " -> ".join(map(str, counts)))
    entrants = [Entrant(n, cfg if n == cfg.model.name else cfg.plan_candidate(n), run_dir / RACE_DIR / n)
                for n in names]
    alive = list(entrants)
    for k, count in enumerate(counts):
        for e in alive:
            _rung(e, k, rung, winner_s)
        alive = sorted(alive, key=lambda e: (-e.top1, -e.images_per_s))
        if k + 1 < len(counts):
            alive = alive[:counts[k + 1]]
    winner, why = decide(alive[0], alive[1]) if len(alive) > 1 else (alive[0], "the only candidate")
    log.info("race: %s wins: %s", winner.name, why)
    spent = time.perf_counter() - started
    record = {"candidates": {e.name: e.rungs for e in entrants}, "winner": winner.name,
              "why": why, "race_s": round(spent, 1), "budget_s": budget}
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
    record = None
    if cfg.train.race != "none" and cfg.train.resume == "none" and hasattr(cfg, "plan_candidate"):
        cfg, record = race(cfg)
    summary = Trainer(cfg, ([LiveReport(on_eval)] if on_eval else []) + list(callbacks)).fit()
    return {**summary, "race": record} if record else summary
