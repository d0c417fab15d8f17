"""Split expressions in the TFDS style: ``train``, ``train[:98%]``, ``train[98%:]``,
``test[:1000]``, ``train[10%:20%]``.

A slice selects from the split's images in a fixed pseudo-random order (a permutation seeded
with 0, independent of ``train.seed``), so ``train[:98%]`` and ``train[98%:]`` are disjoint,
cover the split together, and each holds every class in about its share.

That order is a permutation of the split's image count: one image added to (or removed from) the
folder re-draws every slice, and ``train[90%:]`` then holds mostly images that ``train[:90%]`` held
when a model was trained on it. A run therefore records what each of its splits selected
(:func:`selection_record`: the count and a digest of the names and labels, in its checkpoints and
``class_counts.json``), and evaluating or resuming it on data that now selects other images says so
(:func:`changed_selections`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
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


def selection_record(source, expr: str | None) -> dict:
    """What split expression ``expr`` selected from a source (an
    :class:`~vitflow.data.sources.base.ImageSource`): ``{"split": expr, "images": N, "digest": D}``,
    ``D`` 16 hex digits of SHA-256 over the labels in order and, for sources of files, the names
    relative to the dataset's root (a folder moved or copied elsewhere keeps it; an image added,
    removed, renamed or relabelled changes it). Reads no image; ~10 ms per 100,000 names."""
    h = hashlib.sha256(np.ascontiguousarray(np.asarray(source.labels)).tobytes())
    keys = getattr(source, "keys", None)  # files and tar members: names relative to the root
    if isinstance(keys, np.ndarray):
        h.update(b"\0".join(keys.tolist()) if keys.dtype.kind == "S" else keys.tobytes())
    return {"split": expr, "images": len(source), "digest": h.hexdigest()[:16]}


def changed_selections(recorded: Mapping[str, dict], now: Mapping[str, dict], path) -> list[str]:
    """One line for each expression of ``now`` (role -> :func:`selection_record`) that a split of
    ``recorded`` (a run's records) also names but that now selects other images of ``path``: how
    many, and what it means (a re-drawn slice holds images the run trained on)."""
    lines = []
    for role, rec in now.items():
        old = next((r for r in recorded.values() if r.get("split") == rec["split"] and "digest" in r), None)
        if old is None or old["digest"] == rec["digest"]:
            continue
        sliced = rec["split"] is not None and parse_split(rec["split"]).sliced
        count = (f"{rec['images']} images, not the {old['images']}" if rec["images"] != old["images"] else
                 f"other images (as many, {rec['images']}, but not the same names or labels) than those")
        lines.append(
            f"data.{role}_split={rec['split']!r} of {path} now selects {count} it selected when the run was "
            "trained: the data changed since"
            + (" and the slice was re-drawn (a slice is a random order of the split's image count), so most of "
               "these images are not the ones the run held out and some of them were trained on: put the data "
               "back as it was, or keep the held-out images in folders of their own (val/, test/)" if sliced else
               ": its figures are not comparable with the run's"))
    return lines
