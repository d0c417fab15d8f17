"""The training loop: fetch, forward, loss, backward, clip, step, schedule, evaluate, checkpoint.

Steps are optimizer steps. Each consumes ``train.accum_steps`` micro-batches on every rank;
``train.batch_size`` is the global batch (all micro-batches of all ranks), so accumulation and
data-parallel training both equal one large batch (each micro-batch loss is divided by
``accum_steps``; DDP averages over ranks). What is built before the first step is built by
:mod:`vitflow.training.setup`; everything beside the loop (progress and records, time budget,
pre-emption, best checkpoint and early stopping, trackers, the live report, and the user's own)
is a callback (:mod:`vitflow.training.callbacks`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from vitflow.config import Config, to_yaml
from vitflow.data import train_loader
from vitflow.data.remote.fs import RemoteError
from vitflow.data.sources.evals import open_evals
from vitflow.models import model_kwargs
from vitflow.models.pretrained.config import apply_pretrained
from vitflow.runtime import settled_heap
from vitflow.training.callbacks import Callback, CallbackList, StepOutput
from vitflow.training.normalize import open_run_datasets
from vitflow.training.optim.schedules import schedule_of
from vitflow.training.plan.budget import ProgressiveResizing
from vitflow.training.run.folder import create_run_folder
from vitflow.training.run.preempt import interrupted_end
from vitflow.training.run.resume import locate_run, restore_training, seed_ranks, write_checkpoint
from vitflow.training.run.store_stop import stop_on_store_error
from vitflow.training.scale.distributed import micro_batch, run_precision, shutdown
from vitflow.training.scale.elastic import apply_launch
from vitflow.training.setup import build_model, build_optimization, builtin_callbacks, start_process
from vitflow.training.track.evaluator import RunEvaluator, finish_run
from vitflow.training.track.records import EpochTracker, MetricsLog, start_record
from vitflow.training.track.selection import Selection

log = logging.getLogger(__name__)


class Trainer:
    """Builds everything a run needs from a validated :class:`Config` (see :func:`vitflow.config.build_config`)
    and runs it with :meth:`fit`; ``callbacks`` (user :class:`~vitflow.training.callbacks.Callback` objects) run
    after the built-in ones. Under torchrun every rank builds one; rank 0 alone writes the run directory.

    Raises (at construction, before any training): ConfigError (a metric the data does not evaluate),
    DataError (unusable data), ValueError (incompatible model / class count / checkpoint / batch split),
    FileNotFoundError (a resume path or teacher without a checkpoint).
    """

    def __init__(self, cfg: Config, callbacks: Sequence[Callback] = ()):
        cfg.model, _ = apply_pretrained(cfg.model, cfg.data, getattr(cfg, "key_origins", None))  # auto, preprocessing
        self.cfg, t = cfg, cfg.train
        self.dist, self.device = start_process(t)
        apply_launch(t, cfg.preset, lambda flag: self.dist.any(flag, self.device))  # restarts find their run
        self.state, self.run_dir, start_over, self.claim = locate_run(t, cfg.preset, cfg.to_dict(), self.dist)
        with self.claim.released_on_error():  # one writer per folder; a failed start releases it
            self._build(cfg, callbacks, start_over)

    def _build(self, cfg: Config, callbacks: Sequence[Callback], start_over: bool) -> None:
        """The rest of the set-up, once the run directory is claimed: data, model, optimization, callbacks."""
        t = cfg.train
        self.precision = run_precision(t.precision, self.device, self.dist)  # a resumed run's recorded choices known
        image_size = cfg.model.img_size or model_kwargs(cfg.model.name)["img_size"]
        self.data = open_run_datasets(cfg.data, image_size, self.dist, self.state,  # data.normalize=dataset first
                                      getattr(cfg, "key_origins", None))
        named = open_evals(cfg.data, self.data.classes)  # data.evals, and what keep_best / early stopping watch:
        self.selection = Selection(t.keep_best, t.early_stopping_patience, t.early_stopping_min_delta,
                                   t.early_stopping_metric, [self.data.monitored, *named])
        self.micro_batch = micro_batch(t.batch_size, t.accum_steps, self.dist.world_size)
        parts = build_model(cfg.model, cfg.finetune, cfg.distill, t, self.data, cfg.data.sampler,
                            self.dist.world_size, self.device, self.state)
        self.model, self.model_args, self.tuning, self.ema, self.criterion, self.step, position = parts
        self.parallel, self.net, self.optimizer, self.scheduler, self.guard = build_optimization(
            parts, cfg.optim, t, self.dist, self.device, self.precision)
        self.loader = train_loader(self.data.train, cfg.data, image_size, self.micro_batch, t.seed, self.device,
                                   len(self.data.classes), position, self.dist.rank, self.dist.world_size)
        log.info("input pipeline: %s", self.loader.describe())
        self.callbacks = CallbackList(builtin_callbacks(t, cfg.to_dict(), cfg.preset, self.run_dir, bool(self.state),
                                                        self.dist.is_main, self.loader.describe(), self.selection)
                                      + list(callbacks))
        if self.dist.is_main:  # created now that the data and the model are known to be good
            create_run_folder(self.run_dir, to_yaml(cfg), cfg.preset, self.data)
        saved = self.state or {}
        self.metrics = MetricsLog(self.run_dir, t.tensorboard, self.dist.is_main,
                                  saved.get("records", {} if start_over else None), self.step if self.state else None,
                                  lambda record: self.callbacks.call("on_record", self, record))
        self.epochs = EpochTracker(self.metrics, self.loader.batches_per_epoch, position,
                                   saved.get("data", {}).get("skipped"))
        self.evaluator = RunEvaluator(self.data, cfg.data.eval_batch_size or self.micro_batch, cfg.data.num_workers,
                                      self.device, self.precision, self.dist, self.parallel.kind == "ddp",
                                      self.metrics, self.run_dir, saved.get("threshold"), named)
        self.resizing = ProgressiveResizing(cfg.data.progressive_min_size, image_size, cfg.data.progressive_ramp,
                                            self.model.patch_size, self.model.num_prefix_tokens)
        # the last monitored evaluation's figures, request_stop's reason, the signal that interrupted the run:
        self.last_eval, self.stop_reason, self.interrupted = None, None, None
        self.eval_due = self.finishing = False  # a periodic evaluation runs; the final ones run
        self.eval_requested = False  # a callback asked for an evaluation (and a checkpoint) after this step
        if self.state:
            restore_training(self.state, self)
        seed_ranks(self.state, self.dist, t.seed, self.step)  # last: set-up leaves the model's random stream alone

    @property
    def total_steps(self) -> int:
        return schedule_of(self.scheduler).total_steps

    def request_stop(self, reason: str, interrupt: bool = False) -> None:
        """End the run after the current step (all ranks agree at the step boundary): with the final
        evaluation and checkpoint, or, with ``interrupt`` (a signal), with a checkpoint only."""
        self.stop_reason = self.stop_reason or reason
        if interrupt:
            self.interrupted = self.interrupted or reason

    def request_evaluation(self) -> None:
        """Evaluate, then checkpoint, after the current step (``train.eval_interval``'s clock asks
        so); the ranks agree at the step boundary."""
        self.eval_requested = True

    def train_step(self, batches: list[dict]) -> tuple[float, float, bool]:
        """Forward, loss and backward over the micro-batches (at this step's resolution), clip, then
        the optimizer step, schedule and EMA update unless the non-finite guard refuses the step
        (NonFiniteError after ``train.max_nonfinite_steps`` in a row). Returns ``(loss averaged over
        ranks, gradient norm before clipping, whether the step was taken)``."""
        accum = len(batches)
        if self.resizing.enabled:
            self.loader.set_resolution(self.resizing.resolution(self.step, self.total_steps))
        total = torch.zeros((), device=self.device)
        inputs_finite = torch.ones((), dtype=torch.bool, device=self.device)  # for the guard's diagnosis only
        for i, batch in enumerate(batches):
            x, y = self.loader.device_batch(batch)
            with self.parallel.sync_grads(i == accum - 1):
                with self.precision.autocast():
                    loss = self.criterion(self.net(x), y, x) / accum
                self.precision.backward(loss)
            total += loss.detach()
            inputs_finite &= torch.isfinite(x).all()  # a flag, not the input: micro-batches are freed as they go
        loss = float(self.dist.mean(total))
        norm = self.precision.clip_grad_norm(self.optimizer, self.model.parameters(), self.cfg.optim.clip_grad_norm)
        take = self.guard.check(self.step, loss, norm, self.precision.scaler is not None, inputs_finite)
        self.precision.step(self.optimizer, take)
        self.optimizer.zero_grad(set_to_none=True)
        if take:
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.model)
            self.step += 1
        return loss, norm, take

    def fit(self) -> dict[str, Any]:
        """Train to ``train.total_steps`` (or until a callback stops the run), evaluate, checkpoint;
        returns :func:`~vitflow.training.track.evaluator.run_summary`'s summary. On SIGTERM/SIGINT it stops
        after the current step, writes a checkpoint and returns early (no final evaluation), with
        :func:`~vitflow.training.run.preempt.interrupted_end`'s summary."""
        self.started, summary = time.perf_counter(), None
        self.metrics.write("start", **start_record(self))
        try:
            try:
                self.callbacks.call("on_fit_start", self)  # first: a signal from here on stops the run cleanly
                # log lines above the progress bar, not inside it; the set-up's objects out of the collector's walks
                with logging_redirect_tqdm(), settled_heap():
                    self._loop()
            except RemoteError as e:  # the store stayed unreachable: checkpoint, then one line
                stop_on_store_error(self, e, getattr(self, "_step_start", self.epochs.position), self.started)
            finally:
                self.callbacks.call("on_train_end", self)
                self.loader.close()
            summary = interrupted_end(self) if self.interrupted else finish_run(self)
            return summary
        finally:
            self.callbacks.call("on_fit_end", self, summary)
            self.metrics.close()
            self.claim.release()
            shutdown(self.dist)

    def _loop(self) -> None:
        """Steps until ``total_steps`` or a stop."""
        t, it = self.cfg.train, iter(self.loader)
        self.net.train()
        if (self.state or {}).get("eval_due") and self.step == self.state["step"]:  # stopped inside this evaluation
            self._evaluate_periodic()
        while self.step < self.total_steps and self.stop_reason is None:
            self.tuning.set_phase(self.model, self.step)  # LP-FT: the backbone joins at the switch
            t0, self._step_start = time.perf_counter(), self.epochs.position  # where a resume re-reads from
            batches = [self.epochs.fetch(it) for _ in range(t.accum_steps)]
            wait, cost = time.perf_counter() - t0, self.resizing.step_cost(self.step, self.total_steps)
            loss, grad_norm, taken = self.train_step(batches)
            self.epochs.flush(self.step)
            n = sum(len(b["labels"]) for b in batches)
            self.callbacks.call("on_step_end", self, StepOutput(self.step, loss, grad_norm, n, wait, cost, taken))
            if self._stopping():
                break
            asked = self._evaluation_asked()  # by a callback (train.eval_interval): an evaluation, then a checkpoint
            if taken and (asked or t.eval_every and self.step % t.eval_every == 0) and self.step < self.total_steps:
                self._evaluate_periodic()
                if self._stopping():  # early stopping, a callback
                    break
            if taken and (asked or t.checkpoint_every and self.step % t.checkpoint_every == 0) and \
                    self.step < self.total_steps:
                self.save()
        if self.stop_reason and not self.interrupted and self.stop_reason != self.selection.stopped:
            log.info("%s", self.stop_reason)  # (early stopping said so when it fired)

    def _evaluation_asked(self) -> bool:
        """Whether a callback asked for an evaluation at this step (on any rank: one all-reduce, only
        when ``train.eval_interval`` is set); the request is then consumed."""
        asked, self.eval_requested = self.eval_requested, False
        return bool(self.cfg.train.eval_interval) and self.dist.any(asked, self.device)

    def _stopping(self) -> bool:
        """Whether any rank asked to stop (one all-reduce: every rank then stops after the same step)."""
        if self.dist.any(self.stop_reason is not None, self.device):
            self.stop_reason = self.stop_reason or "another rank stopped"
        return self.stop_reason is not None

    def _evaluate_periodic(self) -> None:
        """The evaluation every ``train.eval_every`` steps. A checkpoint written during it (a store
        lost) has ``eval_due``: a resume runs it first."""
        self.eval_due, self._step_start = True, self.epochs.position  # the step is done: a resume reads on from here
        self.evaluate()
        self.eval_due = False

    def evaluate(self, role: str | None = None) -> dict[str, Any]:
        """Evaluate the trained weights (and the EMA) on the split evaluated during training, or on
        ``role`` (:class:`RunEvaluator`); the former's figures are the ones checkpoints keep. The
        callbacks see each evaluated split (the monitored one first, then the ``data.evals`` ones)."""
        result = self.evaluator(self.model, self.ema.module if self.ema is not None else None, self.step, role)
        split = role or self.evaluator.monitored
        if role is None:
            self.last_eval = {**result, "step": self.step}
        self.callbacks.call("on_evaluation", self, split, result)
        for name, figures in (self.evaluator.named_results.items() if role is None else ()):
            self.callbacks.call("on_evaluation", self, name, figures)
        return result

    def save(self, records: dict[str, int] | None = None, best: bool = False) -> Path | None:
        """:func:`~vitflow.training.run.resume.write_checkpoint` of this step (every rank calls it; rank 0
        writes and returns the path, others ``None``), then the callbacks' ``on_checkpoint``."""
        path = write_checkpoint(self, records, best)
        self.callbacks.call("on_checkpoint", self, path)
        return path
