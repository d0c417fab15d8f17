"""The training loop: fetch, forward, loss, backward, clip, step, schedule, log, evaluate, checkpoint.

Steps are optimizer steps. Each consumes ``train.accum_steps`` micro-batches on every rank;
``train.batch_size`` is the global batch (all micro-batches of all ranks), so accumulation and
data-parallel training both equal one large batch (each micro-batch loss is divided by
``accum_steps``; DDP averages over ranks). Optional features are small objects the loop calls:
the criterion (label loss or distillation), the EMA, the non-finite guard, the stop signals,
the parallel wrapper, the progressive-resizing and time-budget plans, the evaluator, the
metrics log and the fine-tuning decisions (what is frozen, LoRA, LP-FT's switch:
:mod:`vitflow.train.finetune`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from vitflow import checkpoint as ckpt
from vitflow.config import Config, parse_duration
from vitflow.data import check_config as check_data_config
from vitflow.data import train_loader
from vitflow.data.remote.fs import RemoteError
from vitflow.data.sources.evals import open_evals
from vitflow.evaluation import scalar_metrics
from vitflow.models import check_config as check_model_config
from vitflow.models import model_args, model_kwargs
from vitflow.models.kernels import onednn
from vitflow.models.pretrained.config import apply_pretrained
from vitflow.runtime import configure_allocator, mix_seed, quiet, resolve_device, rng_state, set_rng_state, settled_heap
from vitflow.train.budget import ProgressiveResizing, TimeBudget
from vitflow.train.class_weights import setup_imbalance, write_distribution
from vitflow.train.distill import build_criterion
from vitflow.train.distributed import Parallel, init_distributed, micro_batch, rank_device, run_precision, shutdown
from vitflow.train.elastic import apply_launch
from vitflow.train.ema import ModelEMA
from vitflow.train.evaluator import RunEvaluator, summary_figures
from vitflow.train.finetune import FineTuning
from vitflow.train.guards import NonFiniteGuard
from vitflow.train.logging import EpochTracker, Meter, MetricsLog, StallHint, memory_mb
from vitflow.train.normalize import open_run_datasets
from vitflow.train.optim import build_optimizer
from vitflow.train.preempt import Preemption, after_checkpoint
from vitflow.train.resume import locate_run, restore_model, restore_training
from vitflow.train.run_dir import open_run_dir, write_samples
from vitflow.train.schedules import build_scheduler, schedule_of, warn_long_warmup
from vitflow.train.selection import BEST, Selection, after_eval
from vitflow.train.store_stop import stop_on_store_error
from vitflow.train.trackers import check_trackers, open_trackers

log = logging.getLogger(__name__)


class Trainer:
    """Builds everything a run needs from a :class:`Config` and runs it with :meth:`fit`.

    Under torchrun every rank builds a Trainer; rank 0 alone writes the run directory, metrics
    and checkpoints (see :mod:`vitflow.train.distributed`).

    Raises (at construction, before any training):
        ConfigError: a key the model or data layer rejects; vitflow.data.DataError: unusable
        data; ValueError: incompatible model / class count / checkpoint / batch split;
        FileNotFoundError: a resume path or teacher without a checkpoint.
    """

    def __init__(self, cfg: Config, on_eval: Callable[[Path], Any] | None = None):
        apply_pretrained(cfg)  # model.name=auto and the weights' preprocessing, unless the user set them
        check_model_config(cfg.model)
        check_data_config(cfg.data)
        check_trackers(cfg)
        self.cfg, t = cfg, cfg.train
        configure_allocator()
        if t.threads:
            torch.set_num_threads(t.threads)
        self.dist = init_distributed(t.device)
        self.device = rank_device(resolve_device(t.device), self.dist)
        self.precision = run_precision(t.precision, self.device, self.dist)
        apply_launch(cfg, lambda flag: self.dist.any(flag, self.device))  # restarts: a stable run_dir, resumed
        self.state, self.run_dir, start_over = locate_run(cfg, self.dist)
        image_size = cfg.model.img_size or model_kwargs(cfg.model.name)["img_size"]
        self.data = open_run_datasets(cfg, image_size, self.dist, bool(self.state))  # data.normalize=dataset first
        named = open_evals(cfg.data, self.data.classes)  # data.evals, and what keep_best / early stopping watch:
        self.selection = Selection(t.keep_best, t.early_stopping_patience, t.early_stopping_min_delta,
                                   t.early_stopping_metric, [self.data.monitored, *named], (self.state or {}).get("selection"))
        self.micro_batch = micro_batch(t.batch_size, t.accum_steps, self.dist.world_size)
        self.step, position = self._build_model()
        self._build_optimization()
        self.loader = train_loader(self.data.train, cfg.data, image_size, self.micro_batch, t.seed, self.device,
                                   len(self.data.classes), position, self.dist.rank, self.dist.world_size)
        log.info("input pipeline: %s", self.loader.describe())
        trackers = open_trackers(cfg, self.run_dir, bool(self.state)) if self.dist.is_main else None  # MLflow, W&B
        if self.dist.is_main:  # created now that the data and the model are known to be good
            open_run_dir(self.run_dir, cfg)
            write_distribution(self.run_dir, self.data)  # each split's class counts, for the report
        saved = self.state or {}
        self.metrics = MetricsLog(self.run_dir, t.tensorboard, self.dist.is_main, saved.get("records", {} if start_over
                                  else None), self.step if self.state else None, trackers)
        self.epochs = EpochTracker(self.metrics, self.loader.batches_per_epoch, position,
                                   saved.get("data", {}).get("skipped"))
        self.evaluator = RunEvaluator(self.data, cfg.data.eval_batch_size or self.micro_batch, cfg.data.num_workers,
                                      self.device, self.precision, self.dist, self.parallel.kind == "ddp",
                                      self.metrics, self.run_dir, saved.get("threshold"), named)
        self.report_hook = on_eval  # rank 0, after each evaluation: the live report (vitflow.viz.report)
        self.resizing = ProgressiveResizing(cfg.data.progressive_min_size, image_size, cfg.data.progressive_ramp,
                                            self.model.patch_size, self.model.num_prefix_tokens)
        self.last_eval: dict[str, Any] | None = None
        self.eval_due = False  # a periodic evaluation is running (saved: a resume from its checkpoint runs it)
        self.on_eval: list = []  # callback(trainer, metrics) after each evaluation during training (a sweep's pruning)
        self.meter, self.stop = Meter(), Preemption()
        self.stall_hint = StallHint(self.loader.describe())
        self._seed_ranks()  # last, so nothing in set-up consumes the model's random stream (dropout, drop-path)

    # -- set-up ----------------------------------------------------------------------------------

    def _build_model(self) -> tuple[int, tuple[int, int]]:
        """The model (from ``train.seed``; the resumed weights), its EMA and the criterion; returns
        ``(step, loader position)``."""
        cfg, num_classes = self.cfg, len(self.data.classes)
        if cfg.model.num_classes not in (None, num_classes):
            raise ValueError(f"model.num_classes={cfg.model.num_classes} but the data has {num_classes} classes")
        torch.manual_seed(cfg.train.seed)
        t, self.tuning = cfg.train, FineTuning(cfg.finetune, cfg.train.total_steps, self.dist.world_size)
        self.model_args = self.tuning.model_args(model_args(cfg.model, num_classes))  # + LoRA's configuration
        pretrained = cfg.model.pretrained if not self.state else None
        self.model = self.tuning.build(self.model_args, pretrained).to(self.device)
        step, position = (0, (0, 0)) if not self.state else restore_model(self.model, self.state, self.data.classes,
                                                                          cfg.model.name)
        self.tuning.set_phase(self.model, step)  # frozen weights: before the parallel wrapper and the EMA
        self.ema = ModelEMA(self.model, t.ema_decay, t.ema_warmup) if t.ema_decay else None
        self.criterion = build_criterion(cfg.distill, t.label_smoothing, self.model, self.data.classes,
                                         self.data.preprocess, self.device, t.loss, cfg.data.task)
        setup_imbalance(cfg, self.data, self.criterion, self.device)  # train.class_weights; the line on the sampler
        return step, position

    def _build_optimization(self) -> None:
        """The parallel wrapper (and compilation), optimizer, schedule and guard; the resumed
        training state."""
        cfg, t = self.cfg, self.cfg.train
        self.parallel = Parallel(self.dist, t.distributed, self.device)
        if self.ema is not None and self.parallel.kind == "fsdp":
            raise ValueError("train.ema_decay is not supported with train.distributed=fsdp (use ddp)")
        self.net = self.parallel.wrap(self.model)
        if t.compile:
            self.net = torch.compile(self.net)
        with self.tuning.optimizing(self.model):  # LP-FT: the backbone's groups exist from step 0
            self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.total_steps, self.tuning.switch or 0)
        if self.dist.is_main:
            warn_long_warmup(cfg.optim, t.total_steps, "train.total_steps")
        self.guard = NonFiniteGuard(t.max_nonfinite_steps, self.precision.name, cfg.optim.lr, cfg.optim.warmup_steps)
        if self.state:
            restore_training(self.state, self)

    def _seed_ranks(self) -> None:
        """The resumed run's RNG states, or, on several ranks, a different dropout stream each."""
        saved = (self.state or {}).get("rng_ranks") or []
        same_world = len(saved) == self.dist.world_size
        if self.state:
            set_rng_state(saved[self.dist.rank] if same_world else (saved or [self.state["rng"]])[0])
        if self.dist.enabled and not same_world:
            torch.manual_seed(mix_seed(self.cfg.train.seed, self.step, self.dist.rank))

    @property
    def total_steps(self) -> int:
        return schedule_of(self.scheduler).total_steps

    # -- the loop --------------------------------------------------------------------------------

    def fetch(self, it) -> dict:
        """The next micro-batch with at least one readable image (every drawn one is recorded)."""
        while True:
            batch = next(it)
            self.epochs.drawn(batch)
            if len(batch["labels"]):
                return batch

    def train_step(self, batches: list[dict]) -> tuple[float, float, bool]:
        """Forward, loss and backward over the micro-batches (at the progressive-resizing
        resolution of this step), clip, then the optimizer step, schedule and EMA update unless
        the non-finite guard refuses the step.

        Returns:
            ``(loss averaged over ranks, gradient norm before clipping, whether the step was taken)``.
        Raises:
            NonFiniteError: ``train.max_nonfinite_steps`` refused steps in a row.
        """
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
        """Train to ``train.total_steps`` (or the time budget), evaluate, checkpoint.

        On SIGTERM/SIGINT it stops after the current step, writes a checkpoint and returns early
        (no final evaluation) with ``interrupted`` set to the signal's name.

        Returns:
            The final metrics of each evaluated split (``val`` and / or ``test``, the test split
            once, at the end: :func:`~vitflow.train.evaluator.summary_figures`), ``step``,
            ``run_dir``, ``checkpoint``, ``train_images_per_s``, ``skipped_images`` (unreadable
            training images, summed over the epochs), ``skipped_steps``, ``elapsed_s``; or, when
            interrupted, ``interrupted``, ``step``, ``run_dir``, ``checkpoint``, ``elapsed_s``.
        Raises:
            NonFiniteError: see :meth:`train_step`.
        """
        t, started = self.cfg.train, time.perf_counter()
        budget = TimeBudget(parse_duration(t.time_budget), started, self.resizing, self.cfg.optim,
                            2 if self.ema else 1) if t.time_budget else None
        self.metrics.write("start", step=self.step, device=str(self.device), precision=self.precision.name,
                           micro_batch=self.micro_batch, accum_steps=t.accum_steps, world_size=self.dist.world_size,
                           train_images=len(self.data.train), val_images=len(self.data.val or ()),
                           test_images=len(self.data.test or ()), **self.tuning.summary(),
                           resumed_from=self.state["path"] if self.state else None)
        try:
            # log lines above the progress bar, not inside it; the set-up's objects out of the collector's walks
            with self.stop, logging_redirect_tqdm(), settled_heap():
                try:
                    images_seen, train_time = self._loop(budget)
                except RemoteError as e:  # the store stayed unreachable: checkpoint, then one line
                    stop_on_store_error(self, e, getattr(self, "_step_start", self.epochs.position), started)
                finally:
                    self.bar.close()  # also when the loop raised: an error line then starts a line of its own
                    self.loader.close()
            if self.stop.signum:
                return self._interrupted(started)
            summary = self._finish(images_seen, train_time, started)
            self.metrics.write("summary", **summary)
            return summary
        finally:
            self.metrics.close()
            shutdown(self.dist)

    def _finish(self, images_seen: int, train_time: float, started: float) -> dict[str, Any]:
        """The end of a run: the monitored split's evaluation, the final checkpoint, the test split's
        single evaluation, and the summary of :meth:`fit`."""
        records = self.metrics.offsets()  # the final checkpoint's: a resume from it evaluates again, once
        stopped_here = self.selection.stopped and self.last_eval and self.last_eval.get("step") == self.step
        results = {self.evaluator.monitored: self.last_eval if stopped_here else self.run_eval()}
        path = self.save(records)
        if self.evaluator.monitored == "val" and "test" in self.evaluator.splits:  # once, chose nothing
            results["test"] = self.run_eval("test")
        self.epochs.end_partial(self.step)  # after the checkpoint: a resume from it records the epoch whole
        summary = {"step": self.step, "run_dir": str(self.run_dir), "checkpoint": str(path), **self.selection.summary(),
                   "train_images_per_s": images_seen * self.dist.world_size / train_time if train_time else 0.0,
                   "skipped_images": self.epochs.skips.total, "skipped_steps": self.guard.skipped,
                   "elapsed_s": time.perf_counter() - started, **self.tuning.summary(), **summary_figures(results)}
        shown = self.evaluator.splits[self.evaluator.monitored][1]
        if self.dist.is_main and (samples := write_samples(shown, self.run_dir)):
            summary["samples"] = samples
        return summary

    def _loop(self, budget: TimeBudget | None) -> tuple[int, float]:
        """Steps until ``total_steps``, the budget or a stop signal; returns (images seen on this
        rank, seconds since the first step completed)."""
        t = self.cfg.train
        self.bar = bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                              mininterval=1.0, disable=not self.dist.is_main or quiet())  # closed by fit
        it, images_seen, first_step_at = iter(self.loader), 0, None
        self.meter = Meter(**(self.state or {}).get("meter", {}))  # a resumed interval's sums: the same mean loss
        self.net.train()
        if (self.state or {}).get("eval_due") and self.step == self.state["step"]:  # stopped inside this evaluation
            self._periodic_eval()
        while self.step < self.total_steps and not self.selection.stopped:
            self.tuning.set_phase(self.model, self.step)  # LP-FT: the backbone joins at the switch
            t0, self._step_start = time.perf_counter(), self.epochs.position  # where a resume re-reads from
            batches = [self.fetch(it) for _ in range(t.accum_steps)]
            wait, cost = time.perf_counter() - t0, self.resizing.step_cost(self.step, self.total_steps)
            loss, grad_norm, stepped = self.train_step(batches)
            self.epochs.flush(self.step)
            n = sum(len(b["labels"]) for b in batches)
            self.meter.add(n, loss, wait)
            images_seen += n
            first_step_at = first_step_at or time.perf_counter()  # the first step (warm-up) is not timed
            if budget is not None:
                budget.step_done(cost)
            if stepped:
                bar.update(1)
                if self.step % t.log_every == 0:
                    self._log(self.meter, grad_norm, bar)
                    self.meter = Meter()
                    if budget is not None and budget.cost > 0:
                        budget.refit(self.scheduler, self.step, t.total_steps, self.dist,
                                     lambda: self.evaluator.seconds(self.model))
                        bar.total = self.total_steps
            if self.dist.any((budget is not None and budget.over()) or self.stop.signum is not None, self.device):
                if self.stop.signum is None:
                    log.info("time budget %s reached at step %d", t.time_budget, self.step)
                break
            if stepped and t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                if self._periodic_eval():
                    break
            if stepped and t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < self.total_steps:
                self.save()
        return images_seen, (time.perf_counter() - first_step_at if first_step_at else 0.0)

    def _periodic_eval(self) -> bool:
        """The evaluation every ``train.eval_every`` steps and its callbacks; True when it stops the run
        (early stopping). A checkpoint written during it (a store lost) has ``eval_due``: a resume runs it first."""
        self.eval_due, self._step_start = True, self.epochs.position  # the step is done: a resume reads on from here
        result = self.run_eval()
        self.eval_due = False
        for callback in self.on_eval:
            callback(self, result)
        return self.selection.stopped

    def _log(self, meter: Meter, grad_norm: float, bar: tqdm) -> None:
        ips, stall = meter.rate()
        ips *= self.dist.world_size
        loss, lr = meter.loss / meter.steps, max(self.scheduler.get_last_lr())
        self.metrics.write("train", step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, images_per_s=ips,
                           data_stall=stall, memory_mb=memory_mb(self.device), skipped_steps=self.guard.skipped,
                           epoch=self.epochs.position[0],
                           resolution=self.loader.resolution or self.data.preprocess.image_size)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}", stall=f"{stall:.0%}")
        if self.step >= 3 * self.cfg.train.log_every:
            self.stall_hint(stall)

    def run_eval(self, role: str | None = None) -> dict[str, Any]:
        """Evaluate the trained weights (and the EMA) on the split evaluated during training, or on
        ``role`` (:class:`RunEvaluator`); the former's figures are the ones checkpoints keep."""
        result = self.evaluator(self.model, self.ema.module if self.ema is not None else None, self.step, role)
        if role is None:
            self.last_eval = {**result, "step": self.step}
            if self.selection.update(self.step, {self.evaluator.monitored: result, **self.evaluator.named_results}):
                self.save(path=ckpt.checkpoint_path(self.run_dir, self.step).with_name(BEST))
        after_eval(self.report_hook if self.dist.is_main else None, self.run_dir, self.step)
        return result

    def _interrupted(self, started: float) -> dict[str, Any]:
        path = self.save()
        self.epochs.end_partial(self.step)  # the part of the epoch it stopped in, recorded after the checkpoint
        summary = {"interrupted": self.stop.name, "step": self.step, "run_dir": str(self.run_dir),
                   "checkpoint": str(path), "elapsed_s": time.perf_counter() - started}
        self.metrics.write("interrupted", **summary)
        log.warning("%s: checkpoint %s written at step %d; continue with: vitflow resume %s", self.stop.name, path,
                    self.step, self.run_dir)
        after_checkpoint(self.stop.name, self.dist.is_main)  # SIGUSR1 under Slurm: requeue the job
        return summary

    def save(self, records: dict[str, int] | None = None, path: Path | None = None) -> Path | None:
        """Write a checkpoint of the current step and keep the newest ``train.keep_checkpoints``;
        ``records``: the records files' sizes a resume cuts them back to (default: now); ``path``:
        another file (``best.pt``), written atomically alike and never rotated.
        Every rank must call it (FSDP state and the per-rank RNG states are gathered); rank 0
        writes and returns the path, other ranks return ``None``."""
        model_state = self.parallel.model_state(self.model)
        optimizer_state = self.parallel.optimizer_state(self.model, self.optimizer)
        rngs = self.dist.gather(rng_state())
        if not self.dist.is_main:
            return None
        state = {
            "step": self.step, "model": model_state, "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "rng": rngs[0], "rng_ranks": rngs if self.dist.enabled else None,
            "data": {"position": list(self.epochs.position), "skipped": dict(self.epochs.skips.per_epoch)},
            "records": records or self.metrics.offsets(), "meter": self.meter.state_dict(),
            "config": self.cfg.to_dict(), "model_args": self.model_args, "classes": self.data.classes,
            "preprocess": self.data.preprocess.to_dict(), "metrics": scalar_metrics(self.last_eval or {}),
            "task": self.data.task, "threshold": self.evaluator.threshold,
            "ema": self.ema.state_dict() if self.ema is not None else None, "guard": self.guard.state_dict(),
            "selection": self.selection.state_dict(), "eval_due": self.eval_due, "fp32_gemm": onednn.decided(),
        }
        try:
            path = ckpt.save_checkpoint(state, path or ckpt.checkpoint_path(self.run_dir, self.step))
        except ckpt.CheckpointWriteError as e:  # the run stops here; its previous checkpoints are intact
            raise ckpt.CheckpointWriteError(f"{e}; then continue with: vitflow resume {self.run_dir}") from None
        ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        return path


def train(cfg: Config, on_eval: Callable[[Path], Any] | None = None) -> dict[str, Any]:
    """:meth:`Trainer.fit` of a :class:`Trainer` for ``cfg``; ``on_eval(run_dir)``: rank 0, after every evaluation."""
    return Trainer(cfg, on_eval).fit()
