"""Run metrics, written as they happen to files a person or a tool can read at any time:

- ``RUN_DIR/metrics.jsonl``: every record, one JSON object per line (``{"time": unix seconds,
  "kind": ..., ...}``), flushed per record; the source of ``vitflow report``;
- ``RUN_DIR/metrics_train.csv`` and ``RUN_DIR/metrics_eval.csv``: the ``train`` and ``eval``
  records as CSV (columns fixed by the file's first record; a resumed run appends);
- ``RUN_DIR/tb/``: TensorBoard event files with the same scalars, when the ``tensorboard``
  package is installed (optional: ``pip install tensorboard``) and ``train.tensorboard`` is on;
- MLflow and Weights & Biases runs, when switched on (:mod:`vitflow.training.track.trackers`).

Non-finite floats are written as ``null`` / empty.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm  # the notebook bar in Jupyter, the text bar elsewhere

from vitflow.data import SkipReport
from vitflow.rundir import CSV, METRICS
from vitflow.runtime import quiet
from vitflow.training.callbacks import Callback, StepOutput

log = logging.getLogger(__name__)

CSV_KINDS = tuple(CSV)
STALL_HINT = 0.1  # data-stall fraction above which a run says it is input-bound


class MetricsLog:
    """Appends records to the files above; a resumed run appends to the same files, first cut
    back to where they stood when its checkpoint was written (``truncate_to``, from
    :meth:`offsets`), so that the steps between that checkpoint and the interruption are recorded
    once, by the resumed run, exactly as an uninterrupted run records them.

    Args:
        run_dir: the run directory.
        tensorboard: also write TensorBoard events if ``torch.utils.tensorboard`` imports.
        enabled: ``False`` makes every call a no-op (ranks other than 0 of a distributed run).
        truncate_to: file name -> bytes to keep (a file not named is emptied); ``None`` keeps
            everything (a new run, or a checkpoint from before vitflow saved the offsets).
        purge_step: TensorBoard drops its events from this step on (the resumed step).
        listener: called with every record written (the callbacks' ``on_record``: MLflow / W&B).
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True,
                 truncate_to: dict[str, int] | None = None, purge_step: int | None = None,
                 listener: Callable[[dict], None] | None = None):
        self.run_dir, self.enabled, self.listener = Path(run_dir), enabled, listener
        self._csv: dict[str, tuple[Any, csv.DictWriter]] = {}
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if truncate_to is not None:
            for name in (METRICS, *CSV.values()):
                path = self.run_dir / name
                if path.is_file() and path.stat().st_size > truncate_to.get(name, 0):
                    os.truncate(path, truncate_to.get(name, 0))
        self._f = open(self.run_dir / METRICS, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge_step)
            except ImportError:
                log.debug("tensorboard is not installed: no event files")

    def write(self, kind: str, **values: Any) -> dict:
        """Record ``values`` under ``kind``; returns the record."""
        rec = {"time": round(time.time(), 3), "kind": kind, **{k: _clean(v) for k, v in values.items()}}
        if not self.enabled:
            return rec
        self._f.write(json.dumps(rec) + "\n")
        if kind in CSV_KINDS:
            self._csv_writer(kind, rec).writerow({k: v for k, v in rec.items() if _scalar(v)})
        if self._tb is not None and kind in CSV_KINDS and "step" in rec:
            for k, v in rec.items():
                if k not in ("time", "kind", "step", "epoch") and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(f"{kind}/{k}", v, rec["step"])
        if self.listener is not None:
            self.listener(rec)
        return rec

    def offsets(self) -> dict[str, int]:
        """The size in bytes of each records file now (flushed): what a checkpoint saves so that
        a resume can cut the files back to this moment."""
        if not self.enabled:
            return {}
        self._f.flush()
        for f, _ in self._csv.values():
            f.flush()
        return {name: (self.run_dir / name).stat().st_size for name in (METRICS, *CSV.values())
                if (self.run_dir / name).is_file()}

    def _csv_writer(self, kind: str, rec: dict) -> csv.DictWriter:
        if kind not in self._csv:
            path = self.run_dir / CSV[kind]
            fields = None
            if path.is_file() and path.stat().st_size:
                with open(path, newline="") as f:
                    fields = next(csv.reader(f), None)
            f = open(path, "a", newline="", buffering=1)
            writer = csv.DictWriter(f, fieldnames=fields or [k for k, v in rec.items() if _scalar(v)],
                                    extrasaction="ignore")
            if not fields:
                writer.writeheader()
            self._csv[kind] = (f, writer)
        return self._csv[kind][1]

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.close()
        for f, _ in self._csv.values():
            f.close()
        if self._tb is not None:
            self._tb.close()


@dataclass
class Meter:
    """Sums over one logging interval: steps, images, loss and seconds spent waiting for data."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    images: int = 0
    loss: float = 0.0
    data_wait: float = 0.0

    def add(self, images: int, loss: float, data_wait: float) -> None:
        self.steps, self.images, self.loss, self.data_wait = (self.steps + 1, self.images + images, self.loss + loss,
                                                             self.data_wait + data_wait)

    def state_dict(self) -> dict[str, Any]:
        """The sums a checkpoint keeps (steps and loss), so that a resumed run logs the same mean loss."""
        return {"steps": self.steps, "loss": self.loss}

    def rate(self) -> tuple[float, float]:
        """(images/s, fraction of wall time spent waiting for data)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return self.images / elapsed, self.data_wait / elapsed


class EpochTracker:
    """Where training is in its data and what each epoch skipped.

    :meth:`drawn` records every micro-batch as it is drawn: its unreadable images (per epoch) and
    the loader position ``(epoch, next batch index)`` a checkpoint saves. An epoch whose last batch
    was drawn gets its ``epoch`` record from :meth:`flush`, after the step that used the batch
    (one step's micro-batches may end several epochs), so a run that ends with an epoch has its
    record; :meth:`end_partial` records the epoch a run stops in (``partial``, ``batches``), so
    the records sum to the run's total. ``skipped`` restores a resumed run's per-epoch counts.
    """

    def __init__(self, metrics: "MetricsLog", batches_per_epoch: int, position: tuple[int, int] = (0, 0),
                 skipped: dict[int, int] | None = None):
        self.metrics, self.batches_per_epoch, self.position = metrics, batches_per_epoch, tuple(position)
        self.skips = SkipReport()
        self.skips.per_epoch.update(skipped or {})  # a resumed run's counts so far
        self._ended: list[int] = []

    def fetch(self, it) -> dict:
        """The next micro-batch of the loader iterator ``it`` with at least one readable image; every
        drawn one is recorded (:meth:`drawn`)."""
        while True:
            batch = next(it)
            self.drawn(batch)
            if len(batch["labels"]):
                return batch

    def drawn(self, batch: dict) -> None:
        self.skips.add(batch["epoch"], batch["bad"])
        self.position = (batch["epoch"], batch["index"] + 1)
        if self.position[1] == self.batches_per_epoch:
            self._ended.append(batch["epoch"])

    def flush(self, step: int) -> None:
        for epoch in self._ended:
            self._record(epoch, step)
        self._ended.clear()

    def end_partial(self, step: int) -> None:
        if 0 < self.position[1] < self.batches_per_epoch:
            self._record(self.position[0], step, partial=True)

    def _record(self, epoch: int, step: int, partial: bool = False) -> None:
        skipped = self.skips.per_epoch.get(epoch, 0)
        extra = {"partial": True, "batches": self.position[1]} if partial else {}
        self.metrics.write("epoch", epoch=epoch, step=step, skipped_images=skipped, **extra)
        if skipped:
            log.warning("epoch %d: skipped %d unreadable image(s)", epoch, skipped)


def memory_mb(device: torch.device) -> float:
    """Memory in MiB since the last call: on CUDA the peak allocated by tensors (then the peak is
    reset); elsewhere the process's resident set size now (Linux ``/proc``; else its peak)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (int, float, str, bool))


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    return v


class StallHint:
    """Prints, once per run, a hint that the run is input-bound when the data-stall fraction
    (time waiting for the next batch over wall time) passes :data:`STALL_HINT`."""

    def __init__(self, pipeline: str):
        self.pipeline, self.shown = pipeline, False

    def __call__(self, stall: float) -> None:
        if stall > STALL_HINT and not self.shown:
            self.shown = True
            tqdm.write(f"input-bound: {stall:.0%} of the time goes to waiting for data ({self.pipeline}); pack the "
                       "dataset with `vitflow prepare` or raise data.num_workers")


class ProgressLog(Callback):
    """The progress bar and the ``train`` records: sums each step into a :class:`Meter` and, every
    ``log_every`` taken steps, writes a record (loss, lr, gradient norm, images/s, data stall,
    memory, epoch, resolution) and refreshes the bar; hints once when the run is input-bound. The
    interval's sums travel in checkpoints (``meter``), so a resumed run logs the same mean loss."""

    state_key = "meter"

    def __init__(self, log_every: int, pipeline: str):
        self.log_every, self.meter, self.stall_hint, self.bar = log_every, Meter(), StallHint(pipeline), None
        self.images, self.first_step_at, self.last_step_at, self.world_size = 0, None, None, 1

    def images_per_s(self) -> float:
        """Training images/s of the run on all ranks, from the end of its first step (warm-up: not
        timed) to the end of its last; 0 for a run of one step."""
        elapsed = (self.last_step_at - self.first_step_at) if self.first_step_at else 0.0
        return self.images * self.world_size / elapsed if elapsed else 0.0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.meter = Meter(**state)

    def state_dict(self) -> dict[str, Any]:
        return self.meter.state_dict()

    def on_fit_start(self, trainer) -> None:
        self.meter.start, self.world_size = time.perf_counter(), trainer.dist.world_size
        self.bar = tqdm(total=trainer.total_steps, initial=trainer.step, desc="train", unit="step", dynamic_ncols=True,
                        mininterval=1.0, disable=not trainer.dist.is_main or quiet())

    def on_step_end(self, trainer, out: StepOutput) -> None:
        self.meter.add(out.images, out.loss, out.data_wait)
        self.images, self.last_step_at = self.images + out.images, time.perf_counter()
        self.first_step_at = self.first_step_at or self.last_step_at
        if not out.taken:
            return
        self.bar.total = trainer.total_steps  # a time budget may have refitted the schedule
        self.bar.update(1)
        if out.step % self.log_every:
            return
        meter, self.meter = self.meter, Meter()
        ips, stall = meter.rate()
        ips *= trainer.dist.world_size
        loss, lr = meter.loss / meter.steps, max(trainer.scheduler.get_last_lr())
        trainer.metrics.write("train", step=out.step, loss=loss, lr=lr, grad_norm=out.grad_norm, images_per_s=ips,
                              data_stall=stall, memory_mb=memory_mb(trainer.device),
                              skipped_steps=trainer.guard.skipped, epoch=trainer.epochs.position[0],
                              resolution=trainer.loader.resolution or trainer.data.preprocess.image_size)
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", img_s=f"{ips:.0f}", stall=f"{stall:.0%}")
        if out.step >= 3 * self.log_every:
            self.stall_hint(stall)

    def on_train_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()  # also when the loop raised: an error line then starts a line of its own


def start_record(trainer) -> dict[str, Any]:
    """The ``start`` record of a run (a :class:`~vitflow.training.loop.Trainer`): step, device,
    precision, micro-batch, accumulation, ranks, images per split, fine-tuning's summary, and the
    checkpoint a resumed run continues."""
    return dict(step=trainer.step, device=str(trainer.device), precision=trainer.precision.name,
                micro_batch=trainer.micro_batch, accum_steps=trainer.cfg.train.accum_steps,
                world_size=trainer.dist.world_size, train_images=len(trainer.data.train),
                val_images=len(trainer.data.val or ()), test_images=len(trainer.data.test or ()),
                **trainer.tuning.summary(), resumed_from=trainer.state["path"] if trainer.state else None)
