"""The per-shape choices of a ViT, made once per input shape, before its blocks first run on it.

A model's forward reads as the math; what depends on the input's shape, dtype and device is
decided here, by a forward pre-hook on the model's :class:`~vitflow.models.block.Blocks`
(:func:`per_shape_choices`), the first time the blocks see each kind of token input:

- ``grad_checkpointing=auto``: the fewest checkpointed blocks whose saved activations fit the
  budget, from one block's saved bytes measured on the real tokens
  (:class:`~vitflow.models.grad_checkpointing.CheckpointPlan`);
- ``attention=auto``: the fastest exact attention backend, timing the whole block stack with
  each candidate, forward and (when training) backward, with the blocks checkpointed as the real
  step will be (:func:`vitflow.models.attention.auto.tune`).

Both choices are logged. ``cpu_bf16_matmul=auto`` is decided per GEMM shape by each
:class:`~vitflow.models.kernels.matmul.Linear` on its first call of that shape. Nothing runs while the
model is being traced (``torch.compile``, ``torch.export``, TorchScript).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from vitflow.models.attention import AutoKernel, auto
from vitflow.models.grad_checkpointing import saved_activation_bytes
from vitflow.timing import tracing


def _sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (FSDP2's sharded parameters). Only a process that imported
    ``torch.distributed.tensor`` can hold one, so the check never imports it (half a second of
    every ``import vitflow``)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(p, dtensor.DTensor)


def per_shape_choices(blocks: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a :class:`~vitflow.models.block.Blocks` (``args = (x, grid)``, ``x``
    the tokens ``(B, N, D)``): make the ``auto`` choices for this input (see the module docstring);
    a no-op for an input of a kind already seen."""
    if tracing():  # checked first: reading x's shape there would pin a dynamic batch size
        return
    x, grid = args[0], args[1] if len(args) > 1 else None
    if blocks.checkpoint_plan.mode == "auto" and torch.is_grad_enabled():
        plan_checkpointing(blocks, x, grid)
    tune_attention(blocks, x, grid)


def plan_checkpointing(blocks: nn.Module, x: torch.Tensor, grid: tuple[int, int] | None) -> None:
    """Resolve an ``auto`` checkpoint plan for tokens like ``x`` and mark the chosen blocks. The
    saved bytes are measured on the explicit attention path (with ``attention=auto``, before a
    backend is chosen: the exact backend that keeps the most, the N x N probabilities), so the
    plan is conservative."""
    def measure() -> tuple[int, int]:
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), auto.forced("math"):
            per_block = saved_activation_bytes(lambda: blocks[0](x.detach().requires_grad_(), grid),
                                               exclude=list(blocks.parameters()))
        return per_block, x.numel() * x.element_size()

    key = (tuple(x.shape), x.dtype, str(x.device), torch.is_autocast_enabled(x.device.type))
    blocks.set_checkpointed(blocks.checkpoint_plan.blocks(len(blocks), measure, key))


def tune_attention(blocks: nn.Module, x: torch.Tensor, grid: tuple[int, int] | None) -> None:
    """With ``attention=auto``, once per token-input key: choose the backend by timing the whole
    block stack on ``x`` ``(B, N, D)`` with each candidate in every block
    (:func:`~vitflow.models.attention.auto.tune`): forward, plus the backward to ``x`` and the
    blocks' parameters when gradients are on (``torch.autograd.grad``: no ``.grad`` is written).
    Not for FSDP-sharded blocks (their backward hooks would write ``.grad``): there each kernel
    times itself alone on first use."""
    dev = x.device.type
    tkey = (tuple(x.shape), x.dtype, str(x.device), torch.is_grad_enabled(), blocks.training,
            torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev))
    if tkey in blocks.tuned_inputs:
        return
    blocks.tuned_inputs.add(tkey)
    autos = [blk for blk in blocks if isinstance(getattr(blk.attn, "kernel", None), AutoKernel)]
    params = [p for p in blocks.parameters() if p.requires_grad]
    if not autos or any(_sharded(p) for p in params):
        return
    keys = {blk.attn.kernel.key(blk.attn.qkv(blk.norm1(x)), blk.attn.num_heads, blk.attn.context(grid))
            for blk in autos}
    keys = [k for k in sorted(keys, key=str) if not auto.decided(k)]  # one order on every rank (rank 0's choices)
    if not keys:
        return
    backward = any(k[-1] for k in keys)

    def run() -> None:
        xi = x.detach().requires_grad_() if backward else x
        out = blocks.forward(xi, grid)  # .forward: this hook must not run again inside the timing
        if backward:
            torch.autograd.grad(out, [xi, *params], torch.ones_like(out), allow_unused=True)

    auto.tune(keys, list(autos[0].attn.kernel.candidates), run, x.device)
