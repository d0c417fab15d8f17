"""Exponential moving average (EMA) of model weights.

The EMA weights ``e`` follow the trained weights ``w`` after every optimizer step::

    e <- d_n * e + (1 - d_n) * w,     d_n = min(decay, (1 + n) / (10 + n))  (with warmup)

where ``n`` is the number of earlier updates (Polyak & Juditsky 1992; the warmup is TensorFlow's
``ExponentialMovingAverage(num_updates=...)``, also timm's ``ModelEmaV3(use_warmup=True)``
without its power form). Without warmup ``d_n = decay``: the EMA then starts from the
initial weights and needs ~``1 / (1 - decay)`` steps to forget them, which in short runs
leaves it worse than the raw model. Floating-point buffers are averaged like parameters; other
buffers are copied.

How vitflow uses it: the trainer evaluates the EMA beside the raw model (``ema_*`` metrics),
checkpoints carry it under ``"ema"``, and ``eval`` / ``predict`` / ``model_from_checkpoint`` use
the EMA weights when a checkpoint has them (``--weights raw`` picks the trained weights).
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class ModelEMA:
    """An EMA copy of ``model`` (same device and dtype, eval mode, no gradients).

    Args:
        model: the trained (unwrapped) module.
        decay: the EMA decay in ``[0, 1)``, e.g. 0.999 (a horizon of ~1000 steps).
        warmup: use ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates.
    Attributes:
        module: the averaged model; ``updates``: number of :meth:`update` calls.
    """

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True):
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0

    def current_decay(self) -> float:
        """The decay the next :meth:`update` applies."""
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Move the EMA towards ``model``'s current weights (call after each optimizer step)."""
        d = self.current_decay()
        ema, new = [], []
        for e, w in zip(_tensors(self.module), _tensors(model)):
            if e.is_floating_point():
                ema.append(e)
                new.append(w.detach())
            else:
                e.copy_(w)
        if ema:
            torch._foreach_lerp_(ema, new, 1.0 - d)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def _tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()
