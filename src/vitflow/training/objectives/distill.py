"""Training criteria: the label loss (single- or multi-label), and knowledge distillation from a
teacher checkpoint.

A criterion is called as ``criterion(outputs, targets, x) -> loss`` inside the training step's
autocast region: ``outputs`` are the model's logits ``(B, C)`` (or the pair of head logits of a
distilled ViT in training), ``targets`` class indices or Mixup/CutMix soft targets, ``x`` the
normalised input batch the teacher also sees (after Mixup/CutMix, as in DeiT).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.config import DistillConfig, OptimConfig
from vitflow.data.transforms import Preprocess
from vitflow.training.objectives.losses import (
    classification_loss,
    hard_distillation_loss,
    multilabel_loss,
    soft_distillation_loss,
)
from vitflow.training.optim.optimizers import build_optimizer
from vitflow.training.optim.schedules import build_scheduler

log = logging.getLogger(__name__)


class LabelLoss:
    """Cross-entropy with label smoothing (:func:`~vitflow.training.objectives.losses.classification_loss`)."""

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing
        self.weight: torch.Tensor | None = None  # per-class weights (train.class_weights)

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return classification_loss(outputs, targets, self.label_smoothing, self.weight)


class MultiLabelLoss:
    """Binary cross-entropy or the asymmetric loss over multi-hot targets
    (:func:`~vitflow.training.objectives.losses.multilabel_loss`); label smoothing does not apply."""

    def __init__(self, kind: str = "bce"):
        self.kind = kind
        self.pos_weight: torch.Tensor | None = None  # BCE weight of each class's positives (train.class_weights)

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return multilabel_loss(outputs, targets.float(), self.kind, pos_weight=self.pos_weight)


class Teacher:
    """A frozen model from a vitflow checkpoint that scores the student's input batches.

    ``__call__(x)``: ``x`` float ``(B, 3, S, S)`` normalised with the student's ``mean``/``std``
    -> teacher logits ``(B, C)``. The batch is re-normalised with the teacher's own ``mean``/``std``
    and resized to its input size when those differ (its saved preprocessing).

    Raises (at construction):
        FileNotFoundError / ValueError: unreadable checkpoint, or trained on other classes.
    """

    def __init__(self, path: str, classes: list[str], student_pp: Preprocess, device: torch.device):
        state = load_checkpoint(path)
        if list(state["classes"]) != list(classes):
            raise ValueError(f"distill.teacher={path}: the teacher was trained on classes "
                             f"{list(state['classes'])[:5]}..., the data has {list(classes)[:5]}...")
        self.model = model_from_checkpoint(state).to(device).requires_grad_(False)
        self.pp, self.student_pp = Preprocess.from_dict(state["preprocess"]), student_pp
        self.path = state["path"]
        mean_s, std_s = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (student_pp.mean, student_pp.std))
        mean_t, std_t = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (self.pp.mean, self.pp.std))
        # teacher input = (x * std_s + mean_s - mean_t) / std_t, as one multiply-add
        self.scale, self.shift = std_s / std_t, (mean_s - mean_t) / std_t
        self.same_norm = self.pp.mean == student_pp.mean and self.pp.std == student_pp.std
        log.info("distillation teacher %s (%s, step %d)", self.path, state["model_args"]["name"], state["step"])

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.same_norm:
            x = x * self.scale + self.shift
        if x.shape[-1] != self.pp.image_size or x.shape[-2] != self.pp.image_size:
            x = F.interpolate(x, size=(self.pp.image_size, self.pp.image_size), mode=self.pp.interpolation,
                              align_corners=False, antialias=True)
        return self.model(x)


class DistillationLoss:
    """DeiT's objective (Touvron et al. 2021, sec. 5.2)::

        (1 - alpha) * CE_smoothed(cls_logits, targets) + alpha * D(dist_logits, teacher(x))

    with ``D`` the soft (KL at temperature ``tau``) or hard (CE on the teacher's argmax)
    distillation loss. A distilled ViT supplies ``(cls_logits, dist_logits)`` from its two heads;
    any other model uses its one output for both terms.
    """

    def __init__(self, teacher: Teacher, kind: str = "hard", alpha: float = 0.5, tau: float = 1.0,
                 label_smoothing: float = 0.0):
        if kind not in ("soft", "hard"):
            raise ValueError(f"distill.kind must be soft or hard, got {kind!r}")
        self.teacher, self.kind, self.alpha, self.tau = teacher, kind, alpha, tau
        self.label_loss = LabelLoss(label_smoothing)

    def __call__(self, outputs, targets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cls, dist = outputs if isinstance(outputs, tuple) else (outputs, outputs)
        t = self.teacher(x)
        d = soft_distillation_loss(dist, t, self.tau) if self.kind == "soft" else hard_distillation_loss(dist, t)
        return (1 - self.alpha) * self.label_loss(cls, targets, x) + self.alpha * d


def build_criterion(cfg: DistillConfig, label_smoothing: float, model: torch.nn.Module, classes: list[str],
                    pp: Preprocess, device: torch.device, loss: str = "auto", task: str = "multiclass"):
    """The run's criterion: :class:`LabelLoss`; :class:`MultiLabelLoss` for ``task="multilabel"``
    (``loss``: ``bce`` (also ``auto``) or ``asl``); or :class:`DistillationLoss` when
    ``distill.teacher`` is set (which also switches a distilled ViT to returning both heads)."""
    if task == "multilabel":
        return MultiLabelLoss("bce" if loss == "auto" else loss)
    if not cfg.teacher:
        return LabelLoss(label_smoothing)
    if hasattr(model, "distilled_training"):
        model.distilled_training = True
    return DistillationLoss(Teacher(cfg.teacher, classes, pp, device), cfg.kind, cfg.alpha, cfg.tau, label_smoothing)


def distill_finetune(student: nn.Module, teacher: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                     steps: int, lr: float = 5e-4, weight_decay: float = 0.05, alpha: float = 0.5,
                     temperature: float = 2.0, label_smoothing: float = 0.1, precision=None,
                     device: torch.device | str = "cpu", log_every: int = 50) -> list[float]:
    """Fine-tune ``student`` in place for ``steps`` batches with knowledge distillation (Hinton,
    Vinyals & Dean 2015): ``loss = alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) *
    CE(student, labels)``. AdamW over vitflow's parameter groups, linear warmup over 5% of the
    steps then cosine decay to 0 (:mod:`vitflow.training.optim.schedules`); used by ``vitflow prune --finetune-steps``, gradient clipping at 1.0.

    Args:
        batches: an endless iterator of ``(x, targets)`` on ``device``: normalised ``float32
            (B, 3, S, S)`` and class indices ``int64 (B,)`` or soft targets ``(B, C)`` (Mixup),
            e.g. a vitflow train loader finished by its ``pipeline``.
        precision: a :class:`vitflow.runtime.Precision` (autocast); ``None`` for fp32.
    Returns:
        The loss of every step.
    """
    student.to(device).train()
    teacher = teacher.to(device).eval()
    cfg = OptimConfig(lr=lr, weight_decay=weight_decay, warmup_steps=max(1, steps // 20))
    opt = build_optimizer(student, cfg)
    sched = build_scheduler(opt, cfg, steps)
    autocast = precision.autocast if precision is not None else contextlib.nullcontext
    losses, it, t0 = [], iter(batches), time.perf_counter()
    for step in range(steps):
        x, y = next(it)
        with torch.no_grad(), autocast():
            t_logits = teacher(x).float()
        with autocast():
            s_logits = student(x).float()
        loss = (alpha * soft_distillation_loss(s_logits, t_logits, temperature)
                + (1 - alpha) * classification_loss(s_logits, y, label_smoothing))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            log.info("fine-tune step %d/%d: loss %.4f (%.0f s)", step + 1, steps,
                     sum(losses[-log_every:]) / log_every, time.perf_counter() - t0)
    student.eval()
    return losses
