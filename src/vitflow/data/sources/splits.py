"""Split expressions in the TFDS style: ``train``, ``train[:98%]``, ``train[98%:]``,
``test[:1000]``, ``train[10%:20%]``.

A slice selects from the split's images in a fixed pseudo-random order (a permutation seeded
with 0, independent of ``train.seed``), so ``train[:98%]`` and ``train[98%:]`` are disjoint,
cover the split together, and each holds every class in about its share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from vitflow.config import ConfigError, DataConfig

_SPLIT = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\])?\s*$")
SLICE_SEED = 0


@dataclass(frozen=True)
class Split:
    """A parsed split expression: a split ``name`` and optional ``start`` / ``stop`` bounds,
    each an int (an index) or a str ending in ``%`` (a percentage of the split)."""

    name: str
    start: int | str | None = None
    stop: int | str | None = None

    @property
    def sliced(self) -> bool:
        return self.start is not None or self.stop is not None

    def select(self, n: int) -> np.ndarray:
        """Indices (into the split's sorted items, ``0 <= i < n``) this expression selects."""
        if not self.sliced:
            return np.arange(n)
        order = np.random.default_rng(SLICE_SEED).permutation(n)
        return order[_bound(self.start, n, 0):_bound(self.stop, n, n)]


def _bound(b: int | str | None, n: int, default: int) -> int:
    if b is None:
        return default
    if isinstance(b, str):
        return int(round(n * int(b[:-1]) / 100))
    return b


def parse_split(text: str) -> Split:
    """Parse a split expression.

    Raises:
        ValueError: malformed expression or a percentage outside [-100, 100].
    """
    m = _SPLIT.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a split like 'train', 'train[:98%]' or 'test[:1000]'")
    name, bounds = m.group(1), []
    for b in m.group(2, 3):
        if b is not None and b.endswith("%"):
            if not -100 <= int(b[:-1]) <= 100:
                raise ValueError(f"{text!r}: percentage {b} outside [-100%, 100%]")
            bounds.append(b)
        else:
            bounds.append(None if b is None else int(b))
    return Split(name, *bounds)


def check_splits(d: DataConfig) -> None:
    """The split expressions of the data section (part of :func:`vitflow.data.check_config`).

    Raises:
        ConfigError: a malformed ``data.train_split`` / ``data.val_split`` / ``data.test_split``
            (``auto`` and ``none`` are not expressions), naming the key.
    """
    for key in ("train_split", "val_split", "test_split"):
        if key != "train_split" and getattr(d, key).lower() in ("auto", "none"):
            continue
        if ".tar" in getattr(d, key) or "{" in getattr(d, key):
            continue  # shards: a split given as a shard pattern (data/wds/layout.py)
        try:
            parse_split(getattr(d, key))
        except ValueError as e:
            raise ConfigError(f"data.{key}: {e}", f"data.{key}") from None
