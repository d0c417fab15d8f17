"""``grad_checkpointing=auto`` for Swin: which blocks to recompute within an activation budget.

A ViT's blocks all save the same bytes (:func:`vitflow.models.grad_checkpointing.plan_auto`);
a Swin's stages do not (the grid shrinks 4x and the width doubles per stage). For each input
shape, on the first training forward: the stages run once without gradients to find each
stage's input, one block per stage is measured (bytes autograd saves for its backward, explicit
attention so the plan is conservative; :func:`~vitflow.models.grad_checkpointing.saved_activation_bytes`)
and blocks are checkpointed, largest saving first, until ``sum(saved) <= budget``
(a checkpointed block keeps only its input). The choice is logged and kept per input key.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from vitflow.models.attention import auto
from vitflow.models.grad_checkpointing import choose_blocks, saved_activation_bytes
from vitflow.timing import tracing

log = logging.getLogger(__name__)


def _stage_costs(model: nn.Module, x: torch.Tensor) -> list[tuple[int, int]]:
    """Per stage ``(saved bytes of one block, bytes of its input)`` for tokens ``x`` ``(B, H, W, C)``."""
    costs = []
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for stage in model.layers:
            with torch.no_grad():
                x = stage.downsample(x)
            if len(stage.blocks):
                blk = stage.blocks[0]
                with auto.forced("math"):
                    saved = saved_activation_bytes(lambda: blk(x.detach().requires_grad_()),
                                                   exclude=list(model.parameters()))
                costs.append((saved, x.numel() * x.element_size()))
                with torch.no_grad():
                    x = stage.blocks(x)
            else:
                costs.append((0, 0))
    return costs


def plan_swin_checkpointing(model: nn.Module, x: torch.Tensor) -> None:
    """Resolve ``model.checkpoint_plan`` (mode ``auto``) for patch tokens ``x`` ``(B, H, W, C)``
    and mark the chosen blocks (once per input key; nothing while tracing)."""
    if tracing():
        return
    plan = model.checkpoint_plan
    key = (tuple(x.shape), x.dtype, str(x.device), torch.is_autocast_enabled(x.device.type))
    if key not in plan._auto:
        costs = _stage_costs(model, x)
        per_block = [costs[s] for s, stage in enumerate(model.layers) for _ in stage.blocks]
        plan._auto[key] = choose_blocks(per_block, plan.budget)
        log.info("grad checkpointing auto: %d of %d Swin blocks (per stage %s MiB saved per block, budget %.1f MiB)",
                 len(plan._auto[key]), len(per_block), [round(s / 2**20, 1) for s, _ in costs], plan.budget / 2**20)
    model.set_checkpointed(plan._auto[key])
