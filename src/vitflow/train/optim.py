"""Optimizers, parameter groups and per-step learning-rate schedules (the one place for them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vitflow.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weight decay on weight matrices / kernels; none on norms, biases (all 1-D
    parameters) and the names in ``model.no_weight_decay()`` (position embedding, class token)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) or SGD with Nesterov momentum, over :func:`param_groups`."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)


@dataclass
class WarmupDecay:
    """Learning-rate multiplier at optimizer step ``s`` (0-based; the step's own update).

    Linear warmup ``(s + 1) / warmup_steps`` (Goyal et al. 2017), then ``cosine``
    (Loshchilov & Hutter 2017, no restarts), ``linear`` or ``constant`` decay from 1 to
    ``min_ratio`` at ``total_steps``. Picklable, so its state travels in checkpoints.
    """

    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_ratio: float = 0.0

    def __call__(self, s: int) -> float:
        if s < self.warmup_steps:
            return (s + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        t = min(1.0, (s - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * t)) if self.kind == "cosine" else 1.0 - t
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step :class:`torch.optim.lr_scheduler.LambdaLR` driven by :class:`WarmupDecay`."""
    fn = WarmupDecay(total_steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr / cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
