"""Building what a run needs from its config sections, in the order that keeps a run reproducible:
the process (threads, ranks, device), the model (seeded from ``train.seed``; a resumed
run's weights), its EMA and criterion, then the parallel wrapper, optimizer, schedule and the
non-finite guard. Each builder takes the sections it reads, never the whole tree."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vitflow import timing
from vitflow.config import DistillConfig, FinetuneConfig, ModelConfig, OptimConfig, TrainConfig, parse_duration
from vitflow.config.build import flatten
from vitflow.data import Datasets
from vitflow.models import model_args
from vitflow.runtime import Precision, configure_allocator, ensure_signal_stack, resolve_device, use_threads
from vitflow.training.callbacks import Callback
from vitflow.training.objectives.class_weights import setup_imbalance
from vitflow.training.objectives.distill import build_criterion
from vitflow.training.optim.ema import ModelEMA
from vitflow.training.optim.finetune import FineTuning
from vitflow.training.optim.optimizers import build_optimizer
from vitflow.training.optim.schedules import build_scheduler, warn_long_warmup
from vitflow.training.plan.budget import BudgetStop
from vitflow.training.plan.clock import eval_clock
from vitflow.training.run.guards import NonFiniteGuard
from vitflow.training.run.preempt import Preemption
from vitflow.training.run.resume import restore_model
from vitflow.training.scale.distributed import DistEnv, Parallel, init_distributed, rank_device
from vitflow.training.track.records import ProgressLog
from vitflow.training.track.selection import Selection
from vitflow.training.track.trackers import open_trackers

log = logging.getLogger(__name__)


def start_process(t: TrainConfig) -> tuple[DistEnv, torch.device]:
    """The allocator and threads, the process group under torchrun (whose ranks then take rank 0's
    choices made by timing, :func:`vitflow.timing.set_agreement`) and this rank's device:
    ``(dist, device)``. The precision is resolved once a resumed run's recorded choices are known
    (:func:`~vitflow.training.scale.distributed.run_precision`)."""
    configure_allocator()
    ensure_signal_stack()  # before loader workers: their SIGCHLD on an AMX machine (see the function)
    use_threads(t.threads)
    dist = init_distributed(t.device)
    timing.set_agreement(dist.broadcast if dist.enabled else None)
    return dist, rank_device(resolve_device(t.device), dist)


class ModelParts(NamedTuple):
    """The model side of a run: the model (on its device), the arguments that rebuild it, the
    fine-tuning plan, the EMA (or ``None``), the criterion, and where a resumed run stands
    (``step``, loader ``position``)."""

    model: torch.nn.Module
    model_args: dict[str, Any]
    tuning: FineTuning
    ema: ModelEMA | None
    criterion: Any
    step: int
    position: tuple[int, int]


def build_model(m: ModelConfig, finetune: FinetuneConfig, distill: DistillConfig, t: TrainConfig, data: Datasets,
                sampler: str, world_size: int, device: torch.device, state: dict | None) -> ModelParts:
    """The model seeded from ``train.seed`` (with ``model.pretrained``'s weights for a new run, the
    checkpoint's for a resumed one), frozen as fine-tuning says, its EMA and the criterion (weighed
    by ``train.class_weights``; ``sampler``: ``data.sampler``, for the imbalance line).

    Raises:
        ValueError: ``model.num_classes`` differs from the data's class count; a checkpoint of
            other classes or weights that do not fit.
    """
    num_classes = len(data.classes)
    if m.num_classes not in (None, num_classes):
        raise ValueError(f"model.num_classes={m.num_classes} but the data has {num_classes} classes")
    torch.manual_seed(t.seed)
    tuning = FineTuning(finetune, t.total_steps, world_size)
    args = tuning.model_args(model_args(m, num_classes))  # + LoRA's configuration
    model = tuning.build(args, m.pretrained if not state else None).to(device)
    step, position = (0, (0, 0)) if not state else restore_model(model, state, data.classes, m.name)
    tuning.set_phase(model, step)  # frozen weights: before the parallel wrapper and the EMA
    ema = ModelEMA(model, t.ema_decay, t.ema_warmup) if t.ema_decay else None
    criterion = build_criterion(distill, t.label_smoothing, model, data.classes, data.preprocess, device, t.loss,
                                data.task)
    setup_imbalance(t.class_weights, sampler, data, criterion, device)
    return ModelParts(model, args, tuning, ema, criterion, step, position)


class Optimization(NamedTuple):
    """The training side of a run: the parallel wrapper and the network it wraps (compiled with
    ``train.compile``), the optimizer, the schedule and the non-finite guard."""

    parallel: Parallel
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    guard: NonFiniteGuard


def build_optimization(parts: ModelParts, o: OptimConfig, t: TrainConfig, dist: DistEnv, device: torch.device,
                       precision: Precision) -> Optimization:
    """Wrap the model for the ranks, build the optimizer (LP-FT: the backbone's groups exist from
    step 0), the schedule and the guard.

    Raises:
        ValueError: an EMA with FSDP.
    """
    parallel = Parallel(dist, t.distributed, device)
    if parts.ema is not None and parallel.kind == "fsdp":
        raise ValueError("train.ema_decay is not supported with train.distributed=fsdp (use ddp)")
    net = parallel.wrap(parts.model)
    if t.compile:
        net = torch.compile(net)
    with parts.tuning.optimizing(parts.model):
        optimizer = build_optimizer(parts.model, o)
    scheduler = build_scheduler(optimizer, o, t.total_steps, parts.tuning.switch or 0)
    if dist.is_main:
        warn_long_warmup(o, t.total_steps, "train.total_steps")
    guard = NonFiniteGuard(t.max_nonfinite_steps, precision.name, o.lr, o.warmup_steps)
    return Optimization(parallel, net, optimizer, scheduler, guard)


def builtin_callbacks(t: TrainConfig, config: dict[str, Any], preset: str, run_dir: Path, resumed: bool,
                      is_main: bool, pipeline: str, selection: Selection) -> list[Callback]:
    """The run's own callbacks, in calling order: progress and records (``pipeline``: the input
    pipeline's description, for the input-bound hint), the time budget, the evaluation clock
    (``train.eval_interval``), pre-emption signals, the
    best checkpoint and early stopping (``selection``), and on rank 0 (``is_main``) the trackers
    (MLflow / W&B runs named after ``preset``, opened, or continued when ``resumed``, with
    ``config`` (the whole config as a mapping) as parameters)."""
    out: list[Callback] = [ProgressLog(t.log_every, pipeline)]
    if t.time_budget:
        out.append(BudgetStop(parse_duration(t.time_budget), t.time_budget, t.log_every, t.total_steps))
    out += eval_clock(t.eval_interval)
    trackers = open_trackers(t, flatten(config), preset, run_dir, resumed) if is_main else None
    return out + [Preemption(), selection] + ([trackers] if trackers else [])
