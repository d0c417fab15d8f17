"""The evaluations of a training run: the validation split (or, without one, the test split)
during training and at the end, the test split once at the end (the validation split's own figures
when it is that split, ``data.test_split=val``: evaluated once). Each is logged with its split,
``eval.json`` rewritten, a line printed; sharded over the ranks under DDP (single-label)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm  # the notebook bar in Jupyter, the text bar elsewhere

from vitflow.data import Datasets, SkipReport, eval_loader
from vitflow.data.sources.base import ImageSource
from vitflow.evaluation import evaluate, evaluate_multilabel, scalar_metrics
from vitflow.metrics import headline, interval_names, summary_names
from vitflow.rundir import EVAL
from vitflow.runtime import Precision
from vitflow.timing import local_choices
from vitflow.training.run.folder import write_samples
from vitflow.training.scale.distributed import DistEnv
from vitflow.training.track.records import MetricsLog, ProgressLog

log = logging.getLogger(__name__)


class RunEvaluator:
    """Evaluates a run's weights on its validation and test splits.

    ``role`` is ``"val"`` or ``"test"``; :attr:`monitored` is the role evaluated during training
    (``val`` when the data has a validation split). For multi-label data the threshold is chosen
    on the monitored split and applied to the test split (:attr:`threshold`), so a test figure
    never chose anything. Under DDP (``shard``) each rank scores its share of a single-label split
    and the counts are summed; FSDP forwards are collective, so there every rank scores everything,
    as every rank does for multi-label splits. ``skips`` warns once per unreadable image over all
    the run's evaluations (each evaluation still counts its own).
    """

    def __init__(self, data: Datasets, batch_size: int, num_workers: int | str, device: torch.device,
                 precision: Precision, dist: DistEnv, shard: bool, metrics: MetricsLog, run_dir: Path,
                 threshold: float | None = None, named: dict[str, tuple[str, ImageSource]] | None = None):
        self.pp, self.classes, self.multilabel = data.preprocess, data.classes, data.task == "multilabel"
        self.monitored = data.monitored
        self.splits: dict[str, tuple[str, ImageSource]] = {"val": (data.val_split, data.val),
                                                          "test": (data.test_split, data.test)}
        self.splits = {role: v for role, v in self.splits.items() if v[1] is not None}
        self.batch_size, self.num_workers, self.device, self.precision = batch_size, num_workers, device, precision
        self.dist, self.shard, self.metrics, self.run_dir = dist, shard and not self.multilabel, metrics, run_dir
        self.skips = SkipReport()
        self.threshold = threshold  # multi-label: the one chosen so far (a resumed run's, from its checkpoint)
        self.named = named or {}  # data.evals: name -> (split expression, source), evaluated with the monitored split
        self.named_results: dict[str, dict[str, Any]] = {}  # their figures at the latest evaluation
        # data.test_split=val: one split under two names, evaluated once (the test role reuses val's pass)
        self.same = len(self.splits) == 2 and self.splits["val"][0] == self.splits["test"][0]
        self._last_val: tuple[int, dict[str, Any], dict[str, Any] | None] | None = None
        if self.same and dist.is_main:
            log.warning("data.test_split=%s is the validation split itself: it is evaluated once and reported as both "
                        "val and test (its figures chose the run's checkpoints: not a held-out test)",
                        self.splits["test"][0])

    def _evaluate(self, model: torch.nn.Module, source: ImageSource, role: str) -> dict[str, Any]:
        reduce = None
        if self.shard:
            source = source.subset(np.arange(self.dist.rank, len(source), self.dist.world_size))
            reduce = self.dist.all_reduce_sum
        loader = eval_loader(source, self.pp, self.batch_size, self.num_workers)
        with local_choices():  # the ranks' shares may differ in shape: each times its own
            if not self.multilabel:
                return evaluate(model, loader, self.device, self.precision, self.pp, self.skips, reduce,
                                len(self.classes))
            return evaluate_multilabel(model, loader, self.device, self.precision, self.pp, self.skips,
                                       None if self._chooses_threshold(role) else self.threshold)

    def _chooses_threshold(self, role: str) -> bool:
        """Whether an evaluation of ``role`` chooses the multi-label threshold: every one of the
        validation split; of the test split only the first, when there is no validation split."""
        return self.multilabel and role == self.monitored and (role == "val" or self.threshold is None)

    def __call__(self, model: torch.nn.Module, ema: torch.nn.Module | None, step: int,
                 role: str | None = None) -> dict[str, Any]:
        """Evaluate the trained weights (and the EMA's, as ``ema_*``) on the ``role`` split
        (default: the monitored one). Rank 0 writes the ``eval`` record (with ``split``) and
        ``RUN_DIR/eval.json`` (per-class figures of the weights inference uses). Returns the
        metrics of those weights (``raw_*``: the trained ones when an EMA exists)."""
        named, role = role is None, role or self.monitored
        split, source = self.splits[role]
        if self.same and role == "test" and self._last_val is not None and self._last_val[0] == step:
            raw, averaged = self._last_val[1:]  # the validation split's pass of this step, under its second name
        else:
            raw = self._evaluate(model, source, role)
            averaged = self._evaluate(ema, source, role) if ema is not None else None
        if role == "val":
            self._last_val = (step, raw, averaged)
        served = averaged or raw
        if self._chooses_threshold(role):
            self.threshold = served["threshold"]
            if role == "test":
                log.warning("no validation split: the multi-label threshold %.2f is chosen on the test split, so the "
                            "test F1 is optimistic; set data.val_split", self.threshold)
        scalars, kept = scalar_metrics(raw), summary_names()
        if averaged is not None:
            scalars.update({f"ema_{k}": v for k, v in scalar_metrics(averaged).items() if k in kept})
        self.metrics.write("eval", step=step, split=role, split_expr=split, **scalars)
        if self.dist.is_main:
            tmp = self.run_dir / f".{EVAL}.tmp"  # replaced atomically: the live report may read it any time
            tmp.write_text(json.dumps({
                "step": step, "split": role, "split_expr": split, "task": "multilabel" if self.multilabel else
                "multiclass", "weights": "ema" if averaged else "raw", "classes": self.classes, **served}))
            os.replace(tmp, self.run_dir / EVAL)
            msg = f"step {step}: {role} {headline(raw)}"
            if averaged is not None:
                msg += f" | EMA {headline(averaged)}"
            tqdm.write(msg)
        extra = {f"raw_{k}": v for k, v in raw.items() if k in kept} if averaged else {}
        if named:  # after the monitored split: a multi-label threshold is chosen there first
            self.named_results = {name: self._named(model, ema, step, name) for name in self.named}
        return {**served, **extra}

    def _named(self, model: torch.nn.Module, ema: torch.nn.Module | None, step: int, name: str) -> dict[str, Any]:
        """Evaluate a ``data.evals`` split (the EMA's weights when there is one, as inference uses)
        and log it as an ``eval`` record with ``split=name``; returns its figures."""
        split, source = self.named[name]
        result = self._evaluate(ema if ema is not None else model, source, name)
        self.metrics.write("eval", step=step, split=name, split_expr=split, **scalar_metrics(result))
        if self.dist.is_main:
            tqdm.write(f"step {step}: {name} {headline(result)}")
        return result

    def seconds(self, model: torch.nn.Module) -> float:
        """Estimated seconds of the evaluations at the end of the run (this rank's share of the
        monitored split, and of the test split when it is another), from timing two eval batches
        after an untimed one (a new shape's first call is slow on CPU)."""
        bs = self.batch_size
        source = self.splits[self.monitored][1]
        seconds, n = 0.0, 0
        for part in (np.arange(min(len(source), bs)), np.arange(min(len(source), 2 * bs))):
            t0 = time.perf_counter()
            try:
                self._evaluate(model, source.subset(part), self.monitored)
            except ValueError:  # a multi-label sample without a positive label: timed all the same
                pass
            seconds, n = time.perf_counter() - t0, len(part)
        images = sum(len(s) for _, s in [*self.splits.values(), *self.named.values()])
        share = images / (self.dist.world_size if self.shard else 1)
        return seconds / n * share


def summary_figures(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run summary's figures of each evaluated split ``R`` (``results``: role -> what
    :class:`RunEvaluator` returned): ``R_NAME`` for each metric of the table kept in summaries
    (:func:`vitflow.metrics.summary_names`: ``R_loss``, ``R_top1``, ``R_top5`` (fractions), ``R_macro_f1``
    ... or, for multi-label, ``R_map``, ``R_micro_f1``, ``R_threshold`` ...), their 95% intervals
    (``R_top1_ci95``: ``[low, high]``, :func:`vitflow.metrics.interval_names`); ``R_skipped``
    (unreadable images, as in ``eval.json``) — of the weights inference uses: the EMA when
    ``train.ema_decay`` is set, with the trained weights' figures as ``raw_R_*``."""
    out: dict[str, Any] = {}
    kept = (*summary_names(), *interval_names(), "skipped")
    for role, result in results.items():
        out.update({f"{role}_{k}": v for k, v in result.items() if k in kept})
        out.update({f"raw_{role}_{k[4:]}": v for k, v in result.items() if k.startswith("raw_")})
    return out


def run_summary(trainer, results: dict[str, dict[str, Any]], checkpoint: Path | None) -> dict[str, Any]:
    """The summary of a finished run (a :class:`~vitflow.training.loop.Trainer` after its final
    evaluations ``results``): ``step``, ``run_dir``, ``checkpoint``, the best checkpoint's figure,
    ``train_images_per_s`` (all ranks, from the end of the first step), ``skipped_images``, ``skipped_steps``, ``elapsed_s``, fine-tuning's
    summary, each split's figures (:func:`summary_figures`), ``stopped`` (a callback's reason
    other than early stopping's, which says ``early_stopped``) and, on rank 0, ``samples`` (the
    held-out images for ``vitflow predict`` and the report)."""
    summary = {"step": trainer.step, "run_dir": str(trainer.run_dir), "checkpoint": str(checkpoint),
               **trainer.selection.summary(), "train_images_per_s": trainer.callbacks.find(ProgressLog).images_per_s(),
               "skipped_images": trainer.epochs.skips.total, "skipped_steps": trainer.guard.skipped,
               "elapsed_s": time.perf_counter() - trainer.started, **trainer.tuning.summary(),
               **summary_figures(results)}
    if trainer.stop_reason and not trainer.selection.stopped:
        summary["stopped"] = trainer.stop_reason
    # written at the start, but for a user's Dataset (read first by the loader workers: a fork shares the files
    # it opens lazily), written now
    shown = trainer.evaluator.splits[trainer.evaluator.monitored][1]
    if trainer.dist.is_main and (samples := write_samples(shown, trainer.run_dir)):
        summary["samples"] = samples
    return summary


def finish_run(trainer) -> dict[str, Any]:
    """The end of a :class:`~vitflow.training.loop.Trainer`'s run: the monitored split's evaluation
    (unless the stopping one was at this step), the final checkpoint, the test split's single
    evaluation, and the summary (:func:`run_summary`, also written as the ``summary`` record)."""
    trainer.finishing, records = True, trainer.metrics.offsets()  # the final checkpoint's: a resume evaluates once
    last = trainer.last_eval
    stopped_here = trainer.stop_reason and last and last.get("step") == trainer.step
    results = {trainer.evaluator.monitored: last if stopped_here else trainer.evaluate()}
    path = trainer.save(records)
    if trainer.evaluator.monitored == "val" and "test" in trainer.evaluator.splits:  # once, chose nothing
        results["test"] = trainer.evaluate("test")
    trainer.epochs.end_partial(trainer.step)  # after the checkpoint: a resume from it records the epoch whole
    summary = run_summary(trainer, results, path)
    trainer.metrics.write("summary", **summary)
    return summary

