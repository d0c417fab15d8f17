"""The training loop: fetch, forward, loss, backward, clip, step, schedule, log, evaluate,
checkpoint.

Steps are optimizer steps. Each consumes ``train.accum_steps`` micro-batches of
``train.batch_size / train.accum_steps`` images, so accumulation equals one large batch (the
loss of each micro-batch is divided by ``accum_steps``).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vitflow.config import Config, parse_duration, to_yaml
from vitflow.data import Datasets, SkipReport, eval_loader, open_datasets, train_loader
from vitflow.data.augment import progressive_resolution
from vitflow.data.sources import TensorSource, export_samples
from vitflow.models import MODELS, create_model
from vitflow.runtime import configure_allocator
from vitflow.train import checkpoint as ckpt
from vitflow.train.amp import resolve_device, resolve_precision
from vitflow.train.evaluate import evaluate
from vitflow.train.logging import MetricsLog
from vitflow.train.losses import classification_loss
from vitflow.train.optim import build_optimizer, build_scheduler

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
        return ckpt.latest_checkpoint(cfg.train.run_dir)
    runs = [c for d in Path("runs").glob(f"{cfg.preset}-*") if (c := ckpt.latest_checkpoint(d))]
    return max(runs, key=lambda c: c.stat().st_mtime) if runs else None


def model_args(cfg: Config, num_classes: int) -> dict[str, Any]:
    """Arguments of :func:`vitflow.create_model` for this config (saved in checkpoints)."""
    m = cfg.model
    return {"name": m.name, "img_size": m.image_size, "num_classes": num_classes, "embed_dim": m.embed_dim,
            "depth": m.depth, "num_heads": m.num_heads, "mlp_ratio": m.mlp_ratio, "patch_size": m.patch_size,
            "global_pool": m.global_pool, "attention": m.attention, "drop_rate": m.drop_rate,
            "drop_path_rate": m.drop_path_rate}


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


class Trainer:
    """Builds everything a run needs from a validated :class:`Config` and runs it with :meth:`fit`.

    Raises (at construction, before any training):
        vitflow.data.DataError: unusable data; ValueError: incompatible model / class count /
        checkpoint; FileNotFoundError: a resume path without a checkpoint.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        t = cfg.train
        configure_allocator()
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device)
        self.precision = resolve_precision(t.precision, self.device)
        resume = find_resume(cfg)
        self.state = ckpt.load_checkpoint(resume) if resume else None
        self.run_dir = self._run_dir(resume)

        image_size = cfg.model.image_size or MODELS[cfg.model.name]["img_size"]
        self.data: Datasets = open_datasets(cfg.data, image_size)
        num_classes = len(self.data.classes)
        if cfg.model.num_classes not in (None, num_classes):
            raise ValueError(f"model.num_classes={cfg.model.num_classes} but the data has {num_classes} classes")
        torch.manual_seed(t.seed)
        self.model_args = model_args(cfg, num_classes)
        self.model = create_model(pretrained=cfg.model.pretrained if not self.state else None,
                                  **self.model_args).to(self.device)
        self.model.set_grad_checkpointing(cfg.model.grad_checkpointing)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.total_steps)
        self.micro_batch = t.batch_size // t.accum_steps
        self.step, position = 0, (0, 0)
        if self.state:
            position = self._restore(self.state)
        self.loader = train_loader(self.data.train, cfg.data, image_size, self.micro_batch, t.seed, self.device,
                                   num_classes, position)
        log.info("input pipeline: %s", self.loader.describe())
        self.position = position
        self.skips = SkipReport()
        self.skips.add(position[0], self.data.unreadable)
        self._stall_hint_shown = False
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.last_eval: dict[str, float] | None = None
        if self.state:  # last, so nothing in set-up can consume the restored random streams
            ckpt.set_rng_state(self.state["rng"])

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

    def _restore(self, state: dict) -> tuple[int, int]:
        if state["classes"] != self.data.classes:
            raise ValueError(f"checkpoint {state['path']} was trained on classes {state['classes'][:5]}..., "
                             f"the data has {self.data.classes[:5]}...")
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ValueError(f"checkpoint {state['path']} does not fit model {self.cfg.model.name}: {e}") from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["config"]["train"]["total_steps"] != self.cfg.train.total_steps:  # the user changed the length
            self.scheduler.lr_lambdas[0].total_steps = self.cfg.train.total_steps
        if self.precision.scaler is not None and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        log.info("resumed from %s at step %d", state["path"], self.step)
        return tuple(state["data"]["position"])

    # -- the loop ------------------------------------------------------------------------------

    def next_batch(self, it) -> dict:
        """The next micro-batch with at least one readable image; records skips and position."""
        while True:
            batch = next(it)
            if batch["epoch"] > self.position[0]:
                self._end_epoch(self.position[0])
            self.skips.add(batch["epoch"], batch["bad"])
            self.position = (batch["epoch"], batch["index"] + 1)
            if len(batch["labels"]):
                return batch

    def _end_epoch(self, epoch: int) -> None:
        skipped = self.skips.per_epoch.get(epoch, 0)
        self.metrics.write("epoch", epoch=epoch, step=self.step, skipped_images=skipped)
        if skipped:
            log.warning("epoch %d: skipped %d unreadable image(s)", epoch, skipped)

    def train_step(self, batches: list[dict]) -> tuple[float, float]:
        """Forward/backward over the micro-batches, clip, optimizer step. Returns (loss, grad norm)."""
        accum = len(batches)
        self._set_resolution()
        total = torch.zeros((), device=self.device)
        for batch in batches:
            x, y = self.loader.pipeline(batch)
            with self.precision.autocast():
                logits = self.model(x)
            loss = classification_loss(logits, y, self.cfg.train.label_smoothing) / accum
            (self.precision.scaler.scale(loss) if self.precision.scaler else loss).backward()
            total += loss.detach()
        if self.precision.scaler:
            self.precision.scaler.unscale_(self.optimizer)
        clip = self.cfg.optim.clip_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip else math.inf)
        if self.precision.scaler:
            self.precision.scaler.step(self.optimizer)
            self.precision.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return float(total), float(norm)

    def fit(self) -> dict[str, Any]:
        """Train to ``train.total_steps`` (or the time budget), evaluate, checkpoint.

        Returns:
            The final metrics: ``test_loss``, ``test_top1``, ``test_top5`` (fractions), ``step``,
            ``run_dir``, ``checkpoint``, ``train_images_per_s``, ``skipped_images``, ``elapsed_s``.
        """
        t, started = self.cfg.train, time.perf_counter()
        budget = parse_duration(t.time_budget) if t.time_budget else None
        self.metrics.write("start", step=self.step, device=str(self.device), precision=self.precision.name,
                           micro_batch=self.micro_batch, accum_steps=t.accum_steps,
                           train_images=len(self.data.train), test_images=len(self.data.test))
        try:
            images_seen, train_time = self._loop(budget, started)
        finally:
            self.loader.close()
        result = self.run_eval()
        path = self.save()
        elapsed = time.perf_counter() - started
        summary = {"test_loss": result["loss"], "test_top1": result["top1"], "test_top5": result["top5"],
                   "step": self.step, "run_dir": str(self.run_dir), "checkpoint": str(path),
                   "train_images_per_s": images_seen / train_time if train_time else 0.0,
                   "skipped_images": self.skips.total, "elapsed_s": elapsed}
        if isinstance(self.data.test, TensorSource):  # embedded data: give predict some files
            summary["samples"] = str(export_samples(self.data.test, self.run_dir / "samples")[0].parent)
        self.metrics.write("summary", **summary)
        self.metrics.close()
        return summary

    def _loop(self, budget: float | None, started: float) -> tuple[int, float]:
        """Steps until ``total_steps`` or the budget; returns (images seen, seconds since the
        first step completed)."""
        t = self.cfg.train
        bar = tqdm(total=t.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=1.0)
        it, meter, images_seen, first_step_at, cost = iter(self.loader), Meter(), 0, None, 0.0
        self.model.train()
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batches = [self.next_batch(it) for _ in range(t.accum_steps)]
            meter.data_wait += time.perf_counter() - t0
            step_cost = self._step_cost(self.step, self.total_steps)
            loss, grad_norm = self.train_step(batches)
            n = sum(len(b["labels"]) for b in batches)
            meter.steps, meter.images, meter.loss = meter.steps + 1, meter.images + n, meter.loss + loss
            images_seen += n
            if first_step_at is None:  # the first step (warm-up, allocations) is not timed
                first_step_at = time.perf_counter()
            else:
                cost += step_cost
            bar.update(1)
            if self.step % t.log_every == 0:
                ips, stall = meter.rate()
                lr = self.scheduler.get_last_lr()[0]
                self.metrics.write("train", step=self.step, loss=meter.loss / meter.steps, lr=lr, grad_norm=grad_norm,
                                   images_per_s=ips, data_stall=stall, epoch=self.position[0],
                                   resolution=self.loader.pipeline.resolution or self.data.preprocess.image_size)
                bar.set_postfix(loss=f"{meter.loss / meter.steps:.3f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}",
                                stall=f"{stall:.0%}")
                meter = Meter()
                self._maybe_hint(stall)
                if budget and cost > 0:
                    self._fit_budget(budget, started, first_step_at, cost)
                    bar.total = self.total_steps
            if budget and time.perf_counter() - started > budget:
                log.info("time budget %s reached at step %d", t.time_budget, self.step)
                break
            if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                self.run_eval()
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < self.total_steps:
                self.save()
        bar.close()
        return images_seen, (time.perf_counter() - first_step_at if first_step_at else 0.0)

    @property
    def total_steps(self) -> int:
        return self.scheduler.lr_lambdas[0].total_steps

    def _step_cost(self, step: int, total: int) -> float:
        """Compute of ``step`` (of ``total``) relative to a full-resolution step, by tokens per
        image (progressive resizing makes early steps cheaper)."""
        d = self.cfg.data
        if not d.progressive_min_size:
            return 1.0
        p, full, prefix = self.model.patch_size, self.data.preprocess.image_size, self.model.num_prefix_tokens
        r = progressive_resolution(step, total, d.progressive_min_size, full, d.progressive_ramp, p)
        return ((r // p) ** 2 + prefix) / ((full // p) ** 2 + prefix)

    def _fit_budget(self, budget: float, started: float, first_step_at: float, cost_since_first: float) -> None:
        """Set the schedule's length to the most steps that end within ``budget`` seconds, keeping
        time for the final evaluation (a third of the training cost per image). The cost of a
        step is measured so far per full-resolution step and follows the resolution schedule."""
        now = time.perf_counter()
        per_unit = (now - first_step_at) / max(cost_since_first, 1e-9)
        remaining = budget - (now - started) - len(self.data.test) * per_unit / self.cfg.train.batch_size / 3 - 5.0

        def fits(total: int) -> bool:
            return sum(self._step_cost(s, total) for s in range(self.step, total)) * per_unit <= remaining

        lo, hi = self.step + 1, self.cfg.train.total_steps
        if fits(hi):
            lo = hi
        while lo < hi:  # the largest total that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        if abs(lo - self.total_steps) > 0.01 * self.total_steps:
            self.scheduler.lr_lambdas[0].total_steps = lo
            log.info("time budget: schedule set to %d steps", lo)

    def _set_resolution(self) -> None:
        """Progressive resizing: the step's training resolution (eval stays at full size)."""
        d = self.cfg.data
        if d.progressive_min_size:
            self.loader.pipeline.resolution = progressive_resolution(
                self.step, self.total_steps, d.progressive_min_size, self.data.preprocess.image_size,
                d.progressive_ramp, self.model.patch_size)

    def _maybe_hint(self, stall: float) -> None:
        if stall > 0.1 and not self._stall_hint_shown and self.step >= 3 * self.cfg.train.log_every:
            self._stall_hint_shown = True
            tqdm.write(f"input-bound: {stall:.0%} of the time goes to waiting for data "
                       f"({self.loader.describe()}); pack the dataset with `vitflow prepare` or raise "
                       "data.num_workers")

    def run_eval(self) -> dict[str, float]:
        loader = eval_loader(self.data.test, self.data.preprocess, self.cfg.data.eval_batch_size or self.micro_batch,
                             self.cfg.data.num_workers)
        result = evaluate(self.model, loader, self.device, self.precision, self.data.preprocess, self.skips)
        self.metrics.write("eval", step=self.step, split=self.cfg.data.test_split, **result)
        tqdm.write(f"step {self.step}: test loss {result['loss']:.4f} top-1 {result['top1']:.2%} "
                   f"top-5 {result['top5']:.2%}")
        self.last_eval = result
        return result

    def save(self) -> Path:
        """Write a checkpoint of the current step and keep the newest ``train.keep_checkpoints``."""
        state = {
            "step": self.step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "rng": ckpt.rng_state(), "data": {"position": list(self.position)},
            "config": self.cfg.to_dict(), "model_args": self.model_args, "classes": self.data.classes,
            "preprocess": self.data.preprocess.to_dict(), "metrics": self.last_eval or {},
        }
        path = ckpt.save_checkpoint(state, ckpt.checkpoint_path(self.run_dir, self.step))
        ckpt.prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints)
        return path


def train(cfg: Config) -> dict[str, Any]:
    """Build a :class:`Trainer` for ``cfg`` and run it; returns :meth:`Trainer.fit`'s summary."""
    return Trainer(cfg).fit()
