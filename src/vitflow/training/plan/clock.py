"""The clock a planned run knows: this machine's step time measured on the planned model before
step 1 (:func:`measure_clock`), the number of steps a time budget holds (:func:`fit_steps`), and
evaluations spaced in time (``train.eval_interval``, the :class:`EvalClock` callback).

The measurement runs a few real optimizer steps (forward, loss, backward, AdamW step) of a fresh
copy of the planned model on a batch of the training split's own images, decoded and resized as
the evaluation transform does, at the run's precision and thread count; then the rest of a step's
work on the batched path, the device augmentation of each tier (:data:`TIERS`) and the conversion
to model input, and one checkpoint written and synced. What the plan fits the schedule to is a
step with the augmentation the run will use, and an evaluation with the checkpoint after it. The run itself keeps measuring (``train.time_budget``:
:class:`~vitflow.training.plan.budget.BudgetStop` refits the schedule as it goes), so a machine that
slows down or speeds up later still ends the run on time.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vitflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, parse_duration
from vitflow.data import model_input
from vitflow.data.augment.policies import BatchPolicy
from vitflow.data.device import DevicePipeline
from vitflow.data.sources.base import CorruptImageError
from vitflow.data.sources.dispatch import open_training
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.models import create_model, model_args, model_kwargs
from vitflow.runtime import resolve_device, resolve_precision
from vitflow.training.callbacks import Callback, StepOutput
from vitflow.training.optim.optimizers import build_optimizer

log = logging.getLogger(__name__)

TIMED_STEPS = 5  # optimizer steps timed (per thread count) after an untimed one
QUICK_STEPS, QUICK_IMAGES = 2, 16  # a clock like another's: steps timed, images decoded (repeated to the batch)
MAX_PROBE_SECONDS = 8.0  # fewer timed steps when they are slow (per thread count)
# the batched augmentation of each tier the plan chooses from (data.auto_augment, data.random_erasing), after the
# random-resized crop and flip every tier has
TIERS = {"light": ("none", 0.0), "strong": ("trivialaugment", 0.25)}


@dataclass(frozen=True)
class Clock:
    """This machine's speed on the planned model.

    Attributes:
        step_s: median seconds of one optimizer step at the planned batch (all micro-batches).
        eval_image_s: seconds per image of an evaluation forward (no decode: splits are cached).
        decode_s: seconds to decode and resize one training image on one core (the RAM cache's
            start-up cost per image).
        precision: the precision the steps ran in (``bf16``, ``fp32`` ...).
        threads: the torch thread count of ``step_s`` (the faster one measured).
        by_threads: the median step seconds of each thread count measured.
        probe_s: wall-clock seconds the measurement took, model build included.
        augment_s: seconds a step's batch takes through the device pipeline, by tier
            (:data:`TIERS`: crop, flip, the tier's policy and erasing, conversion to model input).
        checkpoint_s: seconds to write and sync one checkpoint (model and optimizer state).
    """

    step_s: float
    eval_image_s: float
    decode_s: float
    precision: str
    threads: int
    by_threads: dict[int, float]
    probe_s: float
    augment_s: dict[str, float] = field(default_factory=dict)
    checkpoint_s: float = 0.0

    def step_cost(self, tier: str) -> float:
        """Seconds of one training step with the augmentation of ``tier``."""
        return self.step_s + self.augment_s.get(tier, 0.0)


def _images(d: DataConfig, size: int, n: int, distinct: int | None = None) -> tuple[torch.Tensor, float]:
    """``uint8 (n, 3, size, size)`` images of the training split (decoded, resized and
    center-cropped as evaluation does; at most ``distinct`` of them decoded, repeated to ``n``, as
    when the split is smaller; random pixels for a split without random access) and the seconds
    one took to decode."""
    pp = Preprocess(size, crop_pct=min(1.0, max(d.crop_pct, 1e-3)), interpolation=d.interpolation)
    transform, images, t0 = eval_transform(pp), [], time.perf_counter()
    try:
        src = open_training(d)
        picks = [] if getattr(src, "streamed", False) else np.linspace(
            0, len(src) - 1, min(n, distinct or n, len(src))).astype(int)
        for i in picks:
            try:
                images.append(transform(src.load(int(i))))
            except CorruptImageError:
                continue
    except (AttributeError, NotImplementedError, TypeError):  # a streamed split: no image by index
        images = []
    decode_s = (time.perf_counter() - t0) / max(len(images), 1)
    if not images:
        return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8), 0.0
    batch = torch.stack(images)
    return batch[torch.arange(n) % len(batch)], decode_s


def measure_clock(m: ModelConfig, d: DataConfig, t: TrainConfig, o: OptimConfig, classes: int,
                  like: Clock | None = None) -> Clock:
    """Time a few optimizer steps (after one untimed step: per-shape kernel choices happen there) of
    a fresh model ``m`` (no pretrained weights: the cost is the architecture's; optimizer ``o``) at
    ``t``'s micro-batch, accumulation and precision, on a batch of ``d``'s training images; then one
    evaluation forward. Unless ``train.threads`` is set, the steps are timed with one thread and
    with torch's default (the cores), and the faster is the clock's ``threads``: on a machine other
    processes keep busy, OpenMP threads waiting for each other can make two threads several times
    slower than one. ``classes``: the head's width. ``m.name`` must be a registered variant
    (resolve ``auto`` first). Leaves torch's thread count as it found it. ``like``: the clock of
    another model on the same data, batch and machine (a race's candidates): only this model's
    steps (:data:`QUICK_STEPS`, at ``like``'s thread count, on :data:`QUICK_IMAGES` images) and its
    evaluation forward are timed, the decode, augmentation and checkpoint costs are ``like``'s.

    Raises:
        DataError: the training split cannot be opened (as :func:`vitflow.data.open_split`).
        ValueError: the model cannot be built from ``m``.
    """
    started, default = time.perf_counter(), torch.get_num_threads()
    device = resolve_device(t.device)
    precision = resolve_precision(t.precision, device)
    size = m.img_size or model_kwargs(m.name)["img_size"]
    micro = t.batch_size // t.accum_steps
    raw, decode_s = _images(d, size, micro, None if like is None else QUICK_IMAGES)
    x = model_input(raw, d.mean, d.std, device)
    y = torch.arange(micro, device=device) % classes
    candidates = [like.threads] if like else [t.threads] if t.threads else (
        [1, default] if default > 1 and device.type == "cpu" else [default])
    medians: dict[int, float] = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's seed stream stays
        torch.manual_seed(0)
        model = create_model(**model_args(m, classes)).to(device).train()
        optimizer = build_optimizer(model, o)
        try:
            for n in candidates:
                torch.set_num_threads(n)
                step = _stepper(model, optimizer, x, y, precision, t.accum_steps, t.label_smoothing, device)
                medians[n] = _median_step(step, min(medians.values(), default=None),
                                          QUICK_STEPS if like else TIMED_STEPS)
            threads = min(medians, key=medians.get)
            torch.set_num_threads(threads)
            eval_image_s = _eval_seconds(model, x, precision, device) / len(x)
            if like is not None:
                decode_s, augment_s, checkpoint_s = like.decode_s, like.augment_s, like.checkpoint_s
            else:
                augment_s = {tier: _augment_seconds(raw, y, size, d, device, tier) * t.accum_steps for tier in TIERS}
                checkpoint_s = _checkpoint_seconds(model, optimizer)
        finally:
            torch.set_num_threads(default)
    return Clock(medians[threads], eval_image_s, decode_s, precision.name, threads, medians,
                 time.perf_counter() - started, augment_s, checkpoint_s)


def _augment_seconds(raw: torch.Tensor, y: torch.Tensor, size: int, d: DataConfig, device: torch.device,
                     tier: str) -> float:
    """Median seconds of the batched device pipeline of ``tier`` on the probe's ``uint8`` batch
    ``raw`` (random-resized crop to ``size``, flip, the tier's policy and erasing, conversion to
    model input), after an untimed call."""
    policy, erasing = TIERS[tier]
    pipe = DevicePipeline(device, d.mean, d.std, 0, None, d.hflip, None, resized_crop=(size, (0.25, 1.0), (3 / 4, 4 / 3)),
                          interpolation=d.interpolation, policy=BatchPolicy(policy, erasing))
    times = []
    for index in range(4):
        t0 = time.perf_counter()
        pipe({"images": raw, "labels": y, "epoch": 0, "index": index})
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _checkpoint_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Seconds to write one checkpoint of ``model`` and ``optimizer`` to a file and sync it."""
    with tempfile.TemporaryFile() as f:
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
        return time.perf_counter() - t0


def _stepper(model, optimizer, x, y, precision, accum: int, smoothing: float, device: torch.device):
    """One optimizer step of ``model`` on ``(x, y)`` as a function returning its seconds."""
    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(accum):
            with precision.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y, label_smoothing=smoothing)
            precision.backward(loss / accum)
        precision.step(optimizer, True)
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0
    return step


def _median_step(step, best: float | None, timed: int = TIMED_STEPS) -> float:
    """The median of up to ``timed`` timed calls of ``step`` after an untimed one, fewer
    past :data:`MAX_PROBE_SECONDS`, or after one that is 1.5x slower than ``best`` (another thread
    count's median: this one loses anyway; an untimed call 3x slower ends it at once)."""
    warm = step()
    if best is not None and warm > 3 * best:
        return warm
    times, t0 = [], time.perf_counter()
    while len(times) < timed:
        times.append(step())
        if time.perf_counter() - t0 > MAX_PROBE_SECONDS or (best is not None and times[-1] > 1.5 * best):
            break
    return statistics.median(times)


@torch.no_grad()
def _eval_seconds(model: torch.nn.Module, x: torch.Tensor, precision, device: torch.device) -> float:
    """Seconds of one evaluation forward of batch ``x`` (after an untimed one)."""
    model.eval()
    seconds = 0.0
    for _ in range(2):  # the first: a new shape's kernel choices
        t0 = time.perf_counter()
        with precision.autocast():
            model(x)
        _sync(device)
        seconds = time.perf_counter() - t0
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def budget_reserve(budget_s: float) -> float:
    """Seconds a time budget keeps for the final checkpoint and the end of the run:
    ``min(5 s, 5%)``, as :class:`~vitflow.training.plan.budget.TimeBudget` keeps."""
    return min(5.0, 0.05 * budget_s)


def fit_steps(budget_s: float, step_s: float, eval_s: float, evaluations: int, final_eval_s: float) -> int:
    """The optimizer steps of ``step_s`` seconds that fit ``budget_s`` with ``evaluations``
    periodic evaluations of ``eval_s`` seconds, the final ones (``final_eval_s``) and
    :func:`budget_reserve`; at least 1."""
    left = budget_s - evaluations * eval_s - final_eval_s - budget_reserve(budget_s)
    return max(1, int(left / max(step_s, 1e-9)))


class EvalClock(Callback):
    """``train.eval_interval``: asks for an evaluation (and a checkpoint after it) each time
    ``seconds`` have passed since the previous one or the start of training, so that a run shows
    figures at regular times whatever its speed. ``text``: the interval as the user wrote it."""

    def __init__(self, seconds: float, text: str):
        self.seconds, self.text, self.due = seconds, text, float("inf")

    def on_fit_start(self, trainer) -> None:
        self.due = time.perf_counter() + self.seconds

    def on_step_end(self, trainer, out: StepOutput) -> None:
        if out.taken and time.perf_counter() >= self.due:
            trainer.request_evaluation()

    def on_evaluation(self, trainer, split: str, metrics) -> None:
        self.due = time.perf_counter() + self.seconds  # after any evaluation: the next one an interval later


def eval_clock(text: str | None) -> list[Callback]:
    """``[EvalClock]`` for ``train.eval_interval=text``, or nothing when unset."""
    return [EvalClock(parse_duration(text), text)] if text else []


EVALUATIONS, FEWEST, EVAL_SHARE, MOST_SHARE = 12, 10, 0.1, 0.25  # evaluations a run aims at, and their time


def evaluation_count(seconds: float, one: float) -> int:
    """Evaluations of ``one`` seconds each in a run of ``seconds``: :data:`EVALUATIONS` while they
    take at most :data:`EVAL_SHARE` of it, down to :data:`FEWEST` (the first within 10% of the
    run), fewer only where even those would take over :data:`MOST_SHARE`."""
    if one <= 0:
        return EVALUATIONS
    n = min(EVALUATIONS, max(FEWEST, int(EVAL_SHARE * seconds / one)))
    return n if n * one <= MOST_SHARE * seconds else max(2, int(MOST_SHARE * seconds / one))
