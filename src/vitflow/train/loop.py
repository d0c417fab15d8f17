"""The training loop: fetch, forward, loss, backward, clip, step, schedule, log, evaluate,
checkpoint.

Steps are optimizer steps. Each consumes ``train.accum_steps`` micro-batches on every rank;
``train.batch_size`` is the global batch (all micro-batches of all ranks), so accumulation and
data-parallel training both equal one large batch (each micro-batch loss is divided by
``accum_steps``; DDP averages over ranks). Optional features are small objects the loop calls:
the criterion (label loss or distillation), the EMA, the non-finite guard, the stop signals,
the parallel wrapper and the metrics log.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from vitflow.config import Config, flatten, parse_duration, to_yaml
from vitflow.data import Datasets, SkipReport, eval_loader, open_datasets, train_loader
from vitflow.data.augment import progressive_resolution
from vitflow.data.loader import mix_seed
from vitflow.data.sources import FileSource, export_samples
from vitflow.models import MODELS, create_model
from vitflow.runtime import configure_allocator, quiet
from vitflow.train import checkpoint as ckpt
from vitflow.train.amp import resolve_device, resolve_precision
from vitflow.train.distill import build_criterion
from vitflow.train.distributed import Parallel, init_distributed, rank_device, shutdown
from vitflow.train.ema import ModelEMA
from vitflow.train.evaluate import evaluate, scalar_metrics
from vitflow.train.guards import NonFiniteGuard, StopSignals
from vitflow.train.logging import MetricsLog, memory_mb
from vitflow.train.optim import build_optimizer
from vitflow.train.schedules import build_scheduler, schedule_of, set_total_steps

log = logging.getLogger(__name__)


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint ``train.resume`` points at.

    ``none``: no resume. ``auto``: the newest complete checkpoint in ``train.run_dir``, or, when
    that is unset, in the most recently written ``runs/<preset>-*`` directory; ``None`` when there
    is none (a fresh run). A path: that checkpoint file or run directory.

    Raises:
        FileNotFoundError: an explicit path that holds no checkpoint.
    """
    r = cfg.train.resume
    if r == "none":
        return None
    if r != "auto":
        p = Path(r)
        found = ckpt.latest_checkpoint(p) if p.is_dir() else p
        if found is None or not found.is_file():
            raise FileNotFoundError(f"train.resume={r}: no checkpoint there")
        return found
    if cfg.train.run_dir:
        found = ckpt.latest_checkpoint(cfg.train.run_dir)
    else:
        runs = [c for d in Path("runs").glob(f"{cfg.preset}-*") if (c := ckpt.latest_checkpoint(d))]
        found = max(runs, key=lambda c: c.stat().st_mtime) if runs else None
    if found is None:
        log.info("train.resume=auto: no checkpoint in %s; starting a new run",
                 cfg.train.run_dir or f"runs/{cfg.preset}-*")
    return found


def model_args(cfg: Config, num_classes: int) -> dict[str, Any]:
    """Arguments of :func:`vitflow.create_model` for this config (saved in checkpoints)."""
    m = cfg.model
    args = {"name": m.name, "img_size": m.image_size, "num_classes": num_classes, "embed_dim": m.embed_dim,
            "depth": m.depth, "num_heads": m.num_heads, "mlp_ratio": m.mlp_ratio, "patch_size": m.patch_size,
            "global_pool": m.global_pool, "attention": m.attention, "drop_rate": m.drop_rate,
            "drop_path_rate": m.drop_path_rate, "pos_embed": m.pos_embed, "layer_scale_init": m.layer_scale,
            "attn_block_size": m.attn_block_size, "attn_window": m.attn_window, "linformer_k": m.linformer_k,
            "performer_features": m.performer_features}
    if m.distill_token:
        args.update(distilled=True, global_pool="token")
    if m.patch_drop_rate:
        args["patch_drop_rate"] = m.patch_drop_rate
    if m.weight_init != "timm":
        args["weight_init"] = m.weight_init
    if m.cpu_bf16_matmul != "auto":
        args["cpu_bf16_matmul"] = m.cpu_bf16_matmul
    return args


_RUN_KEYS = ("train.resume", "train.run_dir", "train.time_budget")  # where/how long, not what is trained


def _warn_config_changes(saved: dict[str, Any], cfg: Config, path: Path) -> None:
    """Log the config keys that differ from the checkpoint's: a resume with another batch size,
    lr, data or model does not reproduce the uninterrupted run (and may not load)."""
    old, new = flatten(saved), flatten(cfg.to_dict())
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if k not in _RUN_KEYS and old.get(k) != new.get(k)]
    if changed:
        log.warning("resuming from %s with a changed config (%s); the run will not match an uninterrupted one",
                    path, "; ".join(changed))


@dataclass
class Meter:
    """Sums over one logging interval."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    images: int = 0
    loss: float = 0.0
    data_wait: float = 0.0

    def rate(self) -> tuple[float, float]:
        """(images/s, fraction of wall time spent waiting for data)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return self.images / elapsed, self.data_wait / elapsed


def _warn_long_warmup(warmup_steps: int, total_steps: int, lr: float, what: str) -> None:
    if warmup_steps >= total_steps:
        log.warning("optim.warmup_steps=%d is not below %s (%d steps): the run ends inside the warmup, at "
                    "%.3g of the peak lr %g", warmup_steps, what, total_steps, total_steps / warmup_steps, lr)


class Trainer:
    """Builds everything a run needs from a validated :class:`Config` and runs it with :meth:`fit`.

    Under torchrun every rank builds a Trainer; rank 0 alone writes the run directory, metrics
    and checkpoints (see :mod:`vitflow.train.distributed`).

    Raises (at construction, before any training):
        vitflow.data.DataError: unusable data; ValueError: incompatible model / class count /
        checkpoint / batch split; FileNotFoundError: a resume path or teacher without a checkpoint.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.train
        configure_allocator()
        if t.threads:
            torch.set_num_threads(t.threads)
        self.dist = init_distributed(t.device)
        self.device = rank_device(resolve_device(t.device), self.dist)
        precision = t.precision
        if precision == "auto":  # a timed choice on a CPU: rank 0 makes it, every rank trains alike
            precision = self.dist.broadcast(resolve_precision("auto", self.device).name if self.dist.is_main else None)
        self.precision = resolve_precision(precision, self.device)
        resume = self.dist.broadcast(find_resume(cfg) if self.dist.is_main else None)
        self.state = ckpt.load_checkpoint(resume) if resume else None
        if self.state and int(self.state["step"]) > t.total_steps and not t.time_budget:  # would rewrite a longer run
            raise ValueError(f"train.resume: {resume} is at step {self.state['step']}, past train.total_steps="
                             f"{t.total_steps}; raise train.total_steps to train on (vitflow eval evaluates it)")
        if self.state and self.dist.is_main:
            _warn_config_changes(self.state.get("config") or {}, cfg, resume)
        self.run_dir = Path(self.dist.broadcast(str(self._run_dir(resume)) if self.dist.is_main else None))

        image_size = cfg.model.image_size or MODELS[cfg.model.name]["img_size"]
        self.data: Datasets = open_datasets(cfg.data, image_size)
        num_classes = len(self.data.classes)
        if cfg.model.num_classes not in (None, num_classes):
            raise ValueError(f"model.num_classes={cfg.model.num_classes} but the data has {num_classes} classes")
        self.micro_batch = self._micro_batch()
        torch.manual_seed(t.seed)
        self.model_args = model_args(cfg, num_classes)
        self.model = create_model(pretrained=cfg.model.pretrained if not self.state else None,
                                  **self.model_args).to(self.device)
        self.model.set_grad_checkpointing(cfg.model.grad_checkpointing, cfg.model.grad_checkpointing_budget)
        self.step, position = 0, (0, 0)
        if self.state:
            position = self._restore_model(self.state)
        self.ema = ModelEMA(self.model, t.ema_decay, t.ema_warmup) if t.ema_decay else None
        self.criterion = build_criterion(cfg.distill, t.label_smoothing, self.model, self.data.classes,
                                         self.data.preprocess, self.device)
        self.parallel = Parallel(self.dist, t.distributed, self.device)
        if self.ema is not None and self.parallel.kind == "fsdp":
            raise ValueError("train.ema_decay is not supported with train.distributed=fsdp (use ddp)")
        self.net = self.parallel.wrap(self.model)
        if t.compile:
            self.net = torch.compile(self.net)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.total_steps)
        if self.dist.is_main:
            _warn_long_warmup(cfg.optim.warmup_steps, t.total_steps, cfg.optim.lr, "train.total_steps")
        self.guard = NonFiniteGuard(t.max_nonfinite_steps, self.precision.name, cfg.optim.lr, cfg.optim.warmup_steps)
        if self.state:
            self._restore_training(self.state)
        self.loader = train_loader(self.data.train, cfg.data, image_size, self.micro_batch, t.seed, self.device,
                                   num_classes, position, self.dist.rank, self.dist.world_size)
        log.info("input pipeline: %s", self.loader.describe())
        self.position = position
        self.skips = SkipReport()  # training epochs only
        self.eval_skips = SkipReport()  # the test split: each evaluation counts its own
        self._epochs_done: list[int] = []  # epochs whose last batch was drawn, recorded after their step
        self._stall_hint_shown = False
        self.metrics = MetricsLog(self.run_dir, t.tensorboard, enabled=self.dist.is_main)
        self.last_eval: dict[str, Any] | None = None
        self._eval_seconds: float | None = None  # time budget: one final evaluation, timed once
        self._probe_seconds = 0.0
        self.stop = StopSignals()
        # last, so nothing in set-up consumes the model's random stream (dropout, drop-path)
        if self.state:
            ranks = self.state.get("rng_ranks") or [self.state["rng"]]
            ckpt.set_rng_state(ranks[self.dist.rank] if len(ranks) == self.dist.world_size else ranks[0])
        if self.dist.enabled and not (self.state and len(self.state.get("rng_ranks") or []) == self.dist.world_size):
            torch.manual_seed(mix_seed(t.seed, self.step, self.dist.rank))  # different dropout on each rank

    # -- setup helpers -------------------------------------------------------------------------

    def _run_dir(self, resume: Path | None) -> Path:
        if self.cfg.train.run_dir:
            d = Path(self.cfg.train.run_dir)
        elif resume is not None:
            d = resume.parent.parent
        else:
            d = Path("runs") / f"{self.cfg.preset}-{dt.datetime.now():%Y%m%d-%H%M%S}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.yaml").write_text(to_yaml(self.cfg))
        return d

    def _micro_batch(self) -> int:
        t, world = self.cfg.train, self.dist.world_size
        if t.batch_size % (t.accum_steps * world):
            raise ValueError(f"train.batch_size={t.batch_size} is not divisible by train.accum_steps={t.accum_steps} "
                             f"x {world} process(es)")
        return t.batch_size // (t.accum_steps * world)

    def _restore_model(self, state: dict) -> tuple[int, int]:
        if state["classes"] != self.data.classes:
            raise ValueError(f"checkpoint {state['path']} was trained on classes {state['classes'][:5]}..., "
                             f"the data has {self.data.classes[:5]}...")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ValueError(f"checkpoint {state['path']} does not fit model {self.cfg.model.name}: {e}") from None
        self.step = int(state["step"])
        return tuple(state["data"]["position"])

    def _restore_training(self, state: dict) -> None:
        self.parallel.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["config"]["train"]["total_steps"] != self.cfg.train.total_steps:  # the user changed the length
            set_total_steps(self.scheduler, self.cfg.train.total_steps)
        if self.precision.scaler is not None and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        if state.get("guard"):
            self.guard.load_state_dict(state["guard"])
        log.info("resumed from %s at step %d", state["path"], self.step)

    # -- the loop ------------------------------------------------------------------------------

    def next_batch(self, it) -> dict:
        """The next micro-batch with at least one readable image; records skips and position, and
        notes an epoch's end when its last batch is drawn (its record is written after that step,
        so a run that ends with an epoch has the record too)."""
        while True:
            batch = next(it)
            self.skips.add(batch["epoch"], batch["bad"])
            self.position = (batch["epoch"], batch["index"] + 1)
            if self.position[1] == self.loader.batches_per_epoch:
                self._epochs_done.append(batch["epoch"])  # one step's micro-batches may end several
            if len(batch["labels"]):
                return batch

    def _end_epoch(self, epoch: int, partial: bool = False) -> None:
        """Write epoch ``epoch``'s metrics record (``partial``: the run stopped inside it, after
        ``batches`` of its batches)."""
        skipped = self.skips.per_epoch.get(epoch, 0)
        extra = {"partial": True, "batches": self.position[1]} if partial else {}
        self.metrics.write("epoch", epoch=epoch, step=self.step, skipped_images=skipped, **extra)
        if skipped:
            log.warning("epoch %d: skipped %d unreadable image(s)", epoch, skipped)

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
        self._set_resolution()
        total = torch.zeros((), device=self.device)
        inputs_finite = torch.ones((), dtype=torch.bool, device=self.device)  # for the guard's diagnosis only
        for i, batch in enumerate(batches):
            x, y = self.loader.pipeline(batch)
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
            The final metrics: ``test_loss``, ``test_top1``, ``test_top5`` (fractions, of the
            weights inference uses: the EMA when ``train.ema_decay`` is set, with the trained
            weights' figures as ``raw_test_*``), ``step``, ``run_dir``, ``checkpoint``,
            ``train_images_per_s``, ``skipped_images`` (unreadable training images, summed over
            the epochs), ``test_skipped`` (unreadable test images, as in ``eval.json``),
            ``skipped_steps``, ``elapsed_s``; or, when
            interrupted, ``interrupted``, ``step``, ``run_dir``, ``checkpoint``, ``elapsed_s``.
        Raises:
            NonFiniteError: see :meth:`train_step`.
        """
        t, started = self.cfg.train, time.perf_counter()
        budget = parse_duration(t.time_budget) if t.time_budget else None
        self.metrics.write("start", step=self.step, device=str(self.device), precision=self.precision.name,
                           micro_batch=self.micro_batch, accum_steps=t.accum_steps, world_size=self.dist.world_size,
                           train_images=len(self.data.train), test_images=len(self.data.test))
        try:
            with self.stop, logging_redirect_tqdm():  # log lines above the progress bar, not inside it
                try:
                    images_seen, train_time = self._loop(budget, started)
                finally:
                    self.loader.close()
            if 0 < self.position[1] < self.loader.batches_per_epoch:  # stopped inside an epoch: record
                self._end_epoch(self.position[0], partial=True)  # its part, so the records sum to the total
            if self.stop.signum:
                return self._interrupted(started)
            result = self.run_eval()
            path = self.save()
            summary = {"test_loss": result["loss"], "test_top1": result["top1"], "test_top5": result["top5"],
                       "step": self.step, "run_dir": str(self.run_dir), "checkpoint": str(path),
                       "train_images_per_s": images_seen * self.dist.world_size / train_time if train_time else 0.0,
                       "skipped_images": self.skips.total, "test_skipped": result["skipped"],
                       "skipped_steps": self.guard.skipped,
                       "elapsed_s": time.perf_counter() - started}
            if self.ema is not None:
                summary.update({f"raw_test_{k}": result[f"raw_{k}"] for k in ("loss", "top1", "top5")})
            test = getattr(self.data.test, "base", None) or self.data.test  # the files behind a RAM cache
            if not isinstance(test, FileSource) and self.dist.is_main:  # no image files (embedded data, CIFAR
                # batches, packed): write a few, so that `vitflow predict` can be tried at once
                summary["samples"] = str(export_samples(self.data.test, self.run_dir / "samples")[0].parent)
            self.metrics.write("summary", **summary)
            return summary
        finally:
            self.metrics.close()
            shutdown(self.dist)

    def _interrupted(self, started: float) -> dict[str, Any]:
        path = self.save()
        summary = {"interrupted": self.stop.name, "step": self.step, "run_dir": str(self.run_dir),
                   "checkpoint": str(path), "elapsed_s": time.perf_counter() - started}
        self.metrics.write("interrupted", **summary)
        log.warning("%s: checkpoint %s written at step %d; continue with train.resume=auto train.run_dir=%s",
                    self.stop.name, path, self.step, self.run_dir)
        return summary

    def _loop(self, budget: float | None, started: float) -> tuple[int, float]:
        """Steps until ``total_steps``, the budget or a stop signal; returns (images seen on this
        rank, seconds since the first step completed)."""
        t = self.cfg.train
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=1.0, disable=not self.dist.is_main or quiet())
        it, meter, images_seen, first_step_at, cost = iter(self.loader), Meter(), 0, None, 0.0
        self.net.train()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batches = [self.next_batch(it) for _ in range(t.accum_steps)]
            meter.data_wait += time.perf_counter() - t0
            step_cost = self._step_cost(self.step, self.total_steps)
            loss, grad_norm, stepped = self.train_step(batches)
            for epoch in self._epochs_done:
                self._end_epoch(epoch)
            self._epochs_done.clear()
            n = sum(len(b["labels"]) for b in batches)
            meter.steps, meter.images, meter.loss = meter.steps + 1, meter.images + n, meter.loss + loss
            images_seen += n
            if first_step_at is None:  # the first step (warm-up, allocations) is not timed
                first_step_at = time.perf_counter()
            else:
                cost += step_cost
            if stepped:
                bar.update(1)
                if self.step % t.log_every == 0:
                    self._log(meter, grad_norm, bar)
                    meter = Meter()
                    if budget and cost > 0:
                        self._fit_budget(budget, started, first_step_at, cost)
                        bar.total = self.total_steps
            over_budget = budget is not None and time.perf_counter() - started > budget
            if self.dist.any(over_budget or self.stop.signum is not None, self.device):
                if self.stop.signum is None:
                    log.info("time budget %s reached at step %d", t.time_budget, self.step)
                break
            if stepped and t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                self.run_eval()
            if stepped and t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        return images_seen, (time.perf_counter() - first_step_at if first_step_at else 0.0)

    def _log(self, meter: Meter, grad_norm: float, bar: tqdm) -> None:
        ips, stall = meter.rate()
        ips *= self.dist.world_size
        loss, lr = meter.loss / meter.steps, max(self.scheduler.get_last_lr())
        self.metrics.write("train", step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, images_per_s=ips,
                           data_stall=stall, memory_mb=memory_mb(self.device), skipped_steps=self.guard.skipped,
                           epoch=self.position[0],
                           resolution=self.loader.pipeline.resolution or self.data.preprocess.image_size)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}", stall=f"{stall:.0%}")
        self._maybe_hint(stall)

    @property
    def total_steps(self) -> int:
        return schedule_of(self.scheduler).total_steps

    def _resolution(self, step: int, total: int) -> int | None:
        """Progressive resizing: the training resolution of ``step`` of ``total``; ``None`` when off."""
        d = self.cfg.data
        if not d.progressive_min_size:
            return None
        return progressive_resolution(step, total, d.progressive_min_size, self.data.preprocess.image_size,
                                      d.progressive_ramp, self.model.patch_size)

    def _step_cost(self, step: int, total: int) -> float:
        """Compute of ``step`` (of ``total``) relative to a full-resolution step, by tokens per
        image (progressive resizing makes early steps cheaper)."""
        r = self._resolution(step, total)
        if r is None:
            return 1.0
        p, full, prefix = self.model.patch_size, self.data.preprocess.image_size, self.model.num_prefix_tokens
        return ((r // p) ** 2 + prefix) / ((full // p) ** 2 + prefix)

    def _fit_budget(self, budget: float, started: float, first_step_at: float, cost_since_first: float) -> None:
        """Set the schedule's length to the most steps that end within ``budget`` seconds, keeping
        time for the final evaluation (timed on a few test batches; twice with an EMA) and the
        checkpoint (``min(5 s, 5% of the budget)``). The cost of a step is measured so far per full-resolution step and follows the
        resolution schedule. Rank 0 decides for all ranks."""
        if self._eval_seconds is None:  # every rank: FSDP forwards are collective
            probe = time.perf_counter()
            self._eval_seconds = self._time_eval()
            self._probe_seconds = time.perf_counter() - probe
        fit = None
        if self.dist.is_main:
            now = time.perf_counter()
            per_unit = (now - first_step_at - self._probe_seconds) / max(cost_since_first, 1e-9)
            evals = 2 if self.ema is not None else 1
            remaining = budget - (now - started) - evals * self._eval_seconds - min(5.0, 0.05 * budget)

            def fits(total: int) -> bool:
                return sum(self._step_cost(s, total) for s in range(self.step, total)) * per_unit <= remaining

            lo, hi = self.step + 1, self.cfg.train.total_steps
            if not self.cfg.data.progressive_min_size:  # every step costs one unit
                lo = hi = min(hi, max(lo, self.step + int(remaining / per_unit)))
            elif fits(hi):
                lo = hi
            while lo < hi:  # the largest total that fits
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
            fit = lo
        fit = self.dist.broadcast(fit)
        if abs(fit - self.total_steps) > 0.01 * self.total_steps:
            set_total_steps(self.scheduler, fit)
            log.info("time budget: schedule set to %d steps", fit)
            if self.dist.is_main:
                _warn_long_warmup(self.cfg.optim.warmup_steps, fit, self.cfg.optim.lr, "the time budget's fitted schedule")

    def _set_resolution(self) -> None:
        """Progressive resizing: the step's training resolution (eval stays at full size)."""
        r = self._resolution(self.step, self.total_steps)
        if r is not None:
            self.loader.pipeline.resolution = r

    def _time_eval(self) -> float:
        """Estimated seconds of one evaluation of this rank's share of the test split, from
        timing two eval batches after an untimed one (a new shape's first call is slow on CPU)."""
        bs = self.cfg.data.eval_batch_size or self.micro_batch
        seconds, n = 0.0, 0
        for part in (np.arange(min(len(self.data.test), bs)), np.arange(min(len(self.data.test), 2 * bs))):
            loader = eval_loader(self.data.test.subset(part), self.data.preprocess, bs, self.cfg.data.num_workers)
            t0 = time.perf_counter()
            evaluate(self.model, loader, self.device, self.precision, self.data.preprocess, self.eval_skips)
            seconds, n = time.perf_counter() - t0, len(part)
        share = len(self.data.test) / (self.dist.world_size if self.parallel.kind == "ddp" else 1)
        return seconds / n * share

    def _maybe_hint(self, stall: float) -> None:
        if stall > 0.1 and not self._stall_hint_shown and self.step >= 3 * self.cfg.train.log_every:
            self._stall_hint_shown = True
            tqdm.write(f"input-bound: {stall:.0%} of the time goes to waiting for data "
                       f"({self.loader.describe()}); pack the dataset with `vitflow prepare` or raise "
                       "data.num_workers")

    def run_eval(self) -> dict[str, Any]:
        """Evaluate the trained weights (and the EMA, as ``ema_*``) on the test split; under DDP
        each rank scores its shard and the counts are summed. Rank 0 writes the ``eval`` record
        and ``RUN_DIR/eval.json`` (confusion matrix and per-class top-1 of the weights inference
        uses). Returns the metrics of those weights (``raw_*``: the trained ones when an EMA exists)."""
        test, reduce = self.data.test, None
        if self.parallel.kind == "ddp":  # FSDP forwards are collective: every rank scores everything
            test = test.subset(np.arange(self.dist.rank, len(test), self.dist.world_size))
            reduce = self.dist.all_reduce_sum
        loader = eval_loader(test, self.data.preprocess, self.cfg.data.eval_batch_size or self.micro_batch,
                             self.cfg.data.num_workers)
        args = (loader, self.device, self.precision, self.data.preprocess, self.eval_skips, reduce,
                len(self.data.classes))
        raw = evaluate(self.model, *args)
        ema = evaluate(self.ema.module, *args) if self.ema is not None else None
        scalars = scalar_metrics(raw)
        if ema is not None:
            scalars.update({f"ema_{k}": ema[k] for k in ("loss", "top1", "top5")})
        self.metrics.write("eval", step=self.step, split=self.cfg.data.test_split, **scalars)
        served = ema or raw
        if self.dist.is_main:
            (self.run_dir / "eval.json").write_text(json.dumps({
                "step": self.step, "split": self.cfg.data.test_split, "weights": "ema" if ema else "raw",
                "classes": self.data.classes, **served}))
        msg = f"step {self.step}: test loss {raw['loss']:.4f} top-1 {raw['top1']:.2%} top-5 {raw['top5']:.2%}"
        if ema is not None:
            msg += f" | EMA top-1 {ema['top1']:.2%} top-5 {ema['top5']:.2%}"
        if self.dist.is_main:
            tqdm.write(msg)
        self.last_eval = {**served, **({f"raw_{k}": raw[k] for k in ("loss", "top1", "top5")} if ema else {})}
        return self.last_eval

    def save(self) -> Path | None:
        """Write a checkpoint of the current step and keep the newest ``train.keep_checkpoints``.
        Every rank must call it (FSDP state and the per-rank RNG states are gathered); rank 0
        writes and returns the path, other ranks return ``None``."""
        model_state = self.parallel.model_state(self.model)
        optimizer_state = self.parallel.optimizer_state(self.model, self.optimizer)
        rngs = self.dist.gather(ckpt.rng_state())
        if not self.dist.is_main:
            return None
        metrics = scalar_metrics(self.last_eval or {})
        state = {
            "step": self.step, "model": model_state, "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "rng": rngs[0], "rng_ranks": rngs if self.dist.enabled else None, "data": {"position": list(self.position)},
            "config": self.cfg.to_dict(), "model_args": self.model_args, "classes": self.data.classes,
            "preprocess": self.data.preprocess.to_dict(), "metrics": metrics,
            "ema": self.ema.state_dict() if self.ema is not None else None, "guard": self.guard.state_dict(),
        }
        path = ckpt.save_checkpoint(state, ckpt.checkpoint_path(self.run_dir, self.step))
        ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        return path


def train(cfg: Config) -> dict[str, Any]:
    """Build a :class:`Trainer` for ``cfg`` and run it; returns :meth:`Trainer.fit`'s summary."""
    return Trainer(cfg).fit()
