"""The evaluations of a training run on its test split: each one logged, ``eval.json`` rewritten,
a line printed; sharded over the ranks under DDP."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from vitflow.data import Preprocess, SkipReport, eval_loader
from vitflow.data.sources import ImageSource
from vitflow.evaluation import evaluate, scalar_metrics
from vitflow.rundir import EVAL
from vitflow.runtime import Precision
from vitflow.train.distributed import DistEnv
from vitflow.train.logging import MetricsLog


class RunEvaluator:
    """Evaluates a run's weights on the test split ``test``.

    Under DDP (``shard``) each rank scores its share and the counts are summed; FSDP forwards are
    collective, so there every rank scores everything. ``skips`` warns once per unreadable test
    image over all the run's evaluations (each evaluation still counts its own).
    """

    def __init__(self, test: ImageSource, pp: Preprocess, classes: list[str], split: str, batch_size: int,
                 num_workers: int | str, device: torch.device, precision: Precision, dist: DistEnv, shard: bool,
                 metrics: MetricsLog, run_dir: Path):
        self.test, self.pp, self.classes, self.split = test, pp, classes, split
        self.batch_size, self.num_workers, self.device, self.precision = batch_size, num_workers, device, precision
        self.dist, self.shard, self.metrics, self.run_dir = dist, shard, metrics, run_dir
        self.skips = SkipReport()

    def __call__(self, model: torch.nn.Module, ema: torch.nn.Module | None, step: int) -> dict[str, Any]:
        """Evaluate the trained weights (and the EMA's, as ``ema_*``). Rank 0 writes the ``eval``
        record and ``RUN_DIR/eval.json`` (confusion matrix and per-class top-1 of the weights
        inference uses). Returns the metrics of those weights (``raw_*``: the trained ones when an
        EMA exists)."""
        test, reduce = self.test, None
        if self.shard:
            test = test.subset(np.arange(self.dist.rank, len(test), self.dist.world_size))
            reduce = self.dist.all_reduce_sum
        loader = eval_loader(test, self.pp, self.batch_size, self.num_workers)
        args = (loader, self.device, self.precision, self.pp, self.skips, reduce, len(self.classes))
        raw = evaluate(model, *args)
        averaged = evaluate(ema, *args) if ema is not None else None
        scalars = scalar_metrics(raw)
        if averaged is not None:
            scalars.update({f"ema_{k}": averaged[k] for k in ("loss", "top1", "top5")})
        self.metrics.write("eval", step=step, split=self.split, **scalars)
        served = averaged or raw
        if self.dist.is_main:
            (self.run_dir / EVAL).write_text(json.dumps({
                "step": step, "split": self.split, "weights": "ema" if averaged else "raw", "classes": self.classes,
                **served}))
            msg = f"step {step}: test loss {raw['loss']:.4f} top-1 {raw['top1']:.2%} top-5 {raw['top5']:.2%}"
            if averaged is not None:
                msg += f" | EMA top-1 {averaged['top1']:.2%} top-5 {averaged['top5']:.2%}"
            tqdm.write(msg)
        return {**served, **({f"raw_{k}": raw[k] for k in ("loss", "top1", "top5")} if averaged else {})}

    def seconds(self, model: torch.nn.Module) -> float:
        """Estimated seconds of one evaluation of this rank's share of the test split, from
        timing two eval batches after an untimed one (a new shape's first call is slow on CPU)."""
        bs = self.batch_size
        seconds, n = 0.0, 0
        for part in (np.arange(min(len(self.test), bs)), np.arange(min(len(self.test), 2 * bs))):
            loader = eval_loader(self.test.subset(part), self.pp, bs, self.num_workers)
            t0 = time.perf_counter()
            evaluate(model, loader, self.device, self.precision, self.pp, self.skips)
            seconds, n = time.perf_counter() - t0, len(part)
        share = len(self.test) / (self.dist.world_size if self.shard else 1)
        return seconds / n * share
