"""Which transformer blocks recompute their activations in the backward pass.

Gradient checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost") keeps
only a block's input and recomputes the rest of its forward during the backward pass; vitflow
uses ``torch.utils.checkpoint`` in its non-reentrant form. A :class:`CheckpointPlan` says which
blocks do it:

- ``none`` / ``all``;
- manual: a list of block indices (``[0, 3, 6]``, or the string ``"0,3,6"``), or every k-th
  block (``"every:2"`` = blocks 0, 2, 4, ...);
- ``auto`` with an activation-memory budget in bytes: the fewest checkpointed blocks such that
  ``(depth - k) * A + k * I <= budget``, where ``A`` is the bytes one block saves for its
  backward (measured on the first batch of each shape with ``saved_tensors_hooks``, weights
  excluded) and ``I`` its input; the ``k`` blocks are spread evenly over the depth.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_bytes(text: str | int | float) -> int:
    """Bytes from ``1073741824``, ``"512MiB"``, ``"1.5GiB"``, ``"800MB"`` (binary units).

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a memory size like 512MiB or 1.5GiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive memory size")
    return int(value * _UNITS[unit])


@dataclass
class CheckpointPlan:
    """A checkpointing mode: ``"none"``, ``"all"``, ``"blocks"`` (``indices``), ``"every"``
    (every ``k``-th block from 0) or ``"auto"`` (``budget`` bytes)."""

    mode: str = "none"
    indices: tuple[int, ...] = ()
    every: int = 1
    budget: int | None = None
    _auto: dict = field(default_factory=dict, repr=False)  # input key -> chosen blocks

    @classmethod
    def parse(cls, spec: bool | str | Sequence[int] | None, budget: int | str | None = None) -> "CheckpointPlan":
        """From ``True`` / ``False`` / ``None``, ``"all"``, ``"none"``, ``"auto"``, ``"every:K"``,
        ``"0,3,6"`` or a sequence of ints; ``budget`` (bytes or ``"1.5GiB"``) is needed by ``auto``.

        Raises:
            ValueError: an unreadable spec, ``every:K`` with ``K < 1``, or ``auto`` without a budget.
        """
        if spec is None or spec is False:
            return cls("none")
        if spec is True:
            return cls("all")
        if not isinstance(spec, str):
            return cls("blocks", tuple(int(i) for i in spec))
        s = spec.strip().lower()
        if s in ("none", "false", "off", ""):
            return cls("none")
        if s in ("all", "true", "on"):
            return cls("all")
        if s == "auto":
            if budget is None:
                raise ValueError("grad checkpointing 'auto' needs a memory budget (e.g. 2GiB)")
            return cls("auto", budget=parse_bytes(budget))
        if m := re.fullmatch(r"every[:=\-_ ]?(\d+)", s):
            if int(m.group(1)) < 1:
                raise ValueError(f"grad checkpointing {spec!r}: every k needs k >= 1")
            return cls("every", every=int(m.group(1)))
        if re.fullmatch(r"\d+(\s*,\s*\d+)*", s):
            return cls("blocks", tuple(int(i) for i in s.split(",")))
        raise ValueError(f"grad checkpointing {spec!r}: use true/false, auto, every:K or block indices like 0,3,6")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def blocks(self, depth: int, measure: Callable[[], tuple[int, int]] | None = None,
               key: tuple = ()) -> frozenset[int]:
        """Indices of the checkpointed blocks of a ``depth``-block model.

        ``measure()`` returns ``(A, I)``: bytes saved by one block and bytes of its input, for the
        current input (called once per ``key`` in ``auto`` mode).

        Raises:
            ValueError: a block index outside ``[0, depth)``.
        """
        if self.mode == "none":
            return frozenset()
        if self.mode == "all":
            return frozenset(range(depth))
        if self.mode == "every":
            return frozenset(range(0, depth, self.every))
        if self.mode == "blocks":
            bad = [i for i in self.indices if not 0 <= i < depth]
            if bad:
                raise ValueError(f"grad checkpointing blocks {bad} out of range for depth {depth}")
            return frozenset(self.indices)
        if key not in self._auto:
            per_block, per_input = measure()
            k = plan_auto(depth, per_block, per_input, self.budget)
            chosen = frozenset(round(i * depth / k) for i in range(k)) if k else frozenset()
            self._auto[key] = chosen
            log.info("grad checkpointing auto: %d of %d blocks (%.1f MiB saved per block, %.1f MiB per checkpointed "
                     "block, budget %.1f MiB)", k, depth, per_block / 2**20, per_input / 2**20, self.budget / 2**20)
        return self._auto[key]


def plan_auto(depth: int, per_block: int, per_input: int, budget: int) -> int:
    """Fewest checkpointed blocks ``k`` with ``(depth - k) * per_block + k * per_input <= budget``;
    ``depth`` (with a warning) when even that does not fit."""
    if depth * per_block <= budget:
        return 0
    saved = per_block - per_input
    k = depth if saved <= 0 else math.ceil((depth * per_block - budget) / saved)
    if k >= depth:
        if depth * per_input > budget:
            log.warning("grad checkpointing auto: %.1f MiB budget is below even all-checkpointed (%.1f MiB)",
                        budget / 2**20, depth * per_input / 2**20)
        return depth
    return k


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensor storages autograd saves while running ``fn()`` (under
    ``saved_tensors_hooks``), not counting the storages of ``exclude`` (e.g. parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def choose_blocks(per_block: list[tuple[int, int]], budget: int) -> frozenset[int]:
    """Indices to checkpoint for a model whose blocks differ in size (the hierarchical families,
    ``grad_checkpointing=auto``): ``per_block[i] = (saved, input)`` bytes of block ``i``; largest
    saving first until the kept bytes fit ``budget`` (all blocks, with a warning, if they never do)."""
    total = sum(s for s, _ in per_block)
    chosen: set[int] = set()
    for i in sorted(range(len(per_block)), key=lambda i: per_block[i][1] - per_block[i][0]):
        if total <= budget:
            break
        saved, inp = per_block[i]
        if saved > inp:
            chosen.add(i)
            total -= saved - inp
    if total > budget:
        log.warning("grad checkpointing auto: %.1f MiB budget is below even all-checkpointed (%.1f MiB)",
                    budget / 2**20, total / 2**20)
    return frozenset(chosen)
