"""Per-channel mean and standard deviation of a split's pixels, measured in one streaming pass, and
the split's content fingerprint they are stored under (:mod:`vitflow.data.stats.store`).

The pass decodes every image as training decodes it (:meth:`ImageSource.load`: ``uint8
(3, H, W)``, grayscale replicated to three channels, alpha dropped, at its own size: no resizing,
no cropping), and adds per channel the pixel count ``n``, the sum ``S1`` of the values and the sum
``S2`` of their squares as exact 64-bit integers. Then, on the 0..1 scale::

    mean = S1 / (255 n)        std = sqrt(n S2 - S1^2) / (255 n)

(Python integers, one division: the population standard deviation over all the split's pixels,
each pixel weighing the same, so a large photo weighs more than a small one). The order of the
images does not change a bit of the result, so the pass runs on worker processes in any order.
With ``sample`` it reads a uniform random sample of that many images (seed 0) instead of all.

The fingerprint (:func:`split_fingerprint`) identifies the split's content without reading its
pixels: SHA-256 over each image's name inside the dataset and its byte size (tar members, files,
packed rows, shard members), or over the pixels themselves for decoded data held in memory (CIFAR
batches, the digits). An image replaced by another file of exactly the same name and byte size is
not noticed: measure again with ``vitflow prepare --stats`` after such an edit.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vitflow.data.encode import encode_images, pixel_sums
from vitflow.data.remote.fs import is_remote
from vitflow.data.sources.base import FileSource, ImageSource, TensorSource
from vitflow.data.sources.packed import PackedSource
from vitflow.data.wds.layout import ShardSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetStats:
    """A split's per-channel statistics on the 0..1 scale (RGB order) and how they were measured.

    ``images``: images read; ``skipped``: unreadable ones left out; ``pixels``: pixels per channel
    summed over; ``sample``: ``None`` when every image was read, else the sample size asked for;
    ``seconds``: the measuring pass's wall time.
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    images: int
    pixels: int
    skipped: int = 0
    sample: int | None = None
    seconds: float = field(default=0.0, compare=False)  # how long, not what: equal statistics compare equal

    def to_dict(self) -> dict:
        return {"mean": list(self.mean), "std": list(self.std), "images": self.images, "pixels": self.pixels,
                "skipped": self.skipped, "sample": self.sample, "seconds": round(self.seconds, 3)}

    @classmethod
    def from_dict(cls, d: dict) -> "DatasetStats":
        """Raises KeyError / TypeError / ValueError on a malformed record."""
        mean, std = tuple(float(v) for v in d["mean"]), tuple(float(v) for v in d["std"])
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ValueError(f"not 3 means and 3 positive standard deviations: {d['mean']}, {d['std']}")
        return cls(mean, std, int(d["images"]), int(d["pixels"]), int(d.get("skipped", 0)),
                   None if d.get("sample") is None else int(d["sample"]), float(d.get("seconds", 0.0)))

    def describe(self) -> str:
        """``mean (0.4914, 0.4822, 0.4465), std (0.2470, 0.2435, 0.2616) over 50000 images``."""
        what = f"a sample of {self.images} images" if self.sample else f"{self.images} images"
        skipped = f", {self.skipped} unreadable left out" if self.skipped else ""
        return f"mean {fmt3(self.mean)}, std {fmt3(self.std)} over {what}{skipped}"


def fmt3(values) -> str:
    """Three figures as ``(0.4914, 0.4822, 0.4465)``."""
    return "(" + ", ".join(f"{v:.4f}" for v in values) + ")"


def stats_from_sums(sums: torch.Tensor, images: int, skipped: int = 0, sample: int | None = None,
                    seconds: float = 0.0) -> DatasetStats:
    """:class:`DatasetStats` from :func:`~vitflow.data.encode.pixel_sums` added over the images (exact integer algebra,
    one rounding per figure). Raises ValueError when no pixel was read."""
    s = [int(v) for v in sums]
    n = s[6]
    if n == 0:
        raise ValueError("no readable image to measure")
    mean = tuple(s[c] / (255 * n) for c in range(3))
    std = tuple(math.sqrt(n * s[3 + c] - s[c] ** 2) / (255 * n) for c in range(3))
    return DatasetStats(mean, std, images, n, skipped, sample, seconds)  # type: ignore[arg-type]


def measure(source: ImageSource, sample: int | None = None, workers: int = 1, desc: str = "statistics"
            ) -> DatasetStats:
    """Per-channel mean and std of ``source``'s images in one pass (see the module text).

    Args:
        sample: read a uniform random sample of this many images (seed 0); ``None``: all of them.
        workers: decoding processes (:func:`~vitflow.data.encode.encode_images`, with a progress
            bar named ``desc``); decoded pixels held in memory are summed here in batches.
    Raises:
        ValueError: ``sample`` < 1, or no readable image.
    """
    if sample is not None and sample < 1:
        raise ValueError(f"--stats-sample must be >= 1 (got {sample})")
    t0, n = time.perf_counter(), len(source)
    sampled = sample is not None and sample < n
    if sampled:
        source = source.subset(np.sort(np.random.default_rng(0).choice(n, size=sample, replace=False)))
    total, skipped = torch.zeros(7, dtype=torch.int64), 0
    if isinstance(source, TensorSource) and not source.errors:  # decoded pixels in RAM: batched sums
        for a in range(0, len(source), 1024):
            total += pixel_sums(source.load_batch(np.arange(a, min(a + 1024, len(source)))))
    else:
        for i, sums, error in encode_images(source, "sums", None, 0, workers, desc):
            if sums is None:
                skipped += 1
                log.warning("statistics: left out unreadable image %s: %s", source.name(i), error)
            else:
                total += torch.from_numpy(sums)
    return stats_from_sums(total, len(source) - skipped, skipped, sample if sampled else None,
                           time.perf_counter() - t0)


def split_fingerprint(source: ImageSource) -> str:
    """16 hex digits identifying ``source``'s images by content (see the module text): the same
    files copied elsewhere keep it, a file added, removed, renamed or resized changes it."""
    h = hashlib.sha256(type(source).__name__.encode())
    if isinstance(source, TensorSource):
        for a in range(0, len(source), 4096):
            h.update(source.load_batch(np.arange(a, min(a + 4096, len(source)))).numpy().tobytes())
        return h.hexdigest()[:16]
    for name, size in _entries(source):
        h.update(name)
        h.update(b"\0%d\0" % size)
    return h.hexdigest()[:16]


def _entries(source: ImageSource):
    """``(name bytes, byte size or -1)`` of each image, names relative to the dataset's root."""
    if isinstance(source, FileSource):
        if source.spans is not None:
            return zip(source.keys, source.spans[:, 1].tolist())
        root = source.reader.root
        if is_remote(root):
            return ((k, -1) for k in source.keys)
        return ((k, os.stat(os.path.join(root, os.fsdecode(k))).st_size) for k in source.keys)
    if isinstance(source, PackedSource):
        names = [bytes(source._names[r]) for r in source.rows]
        if source.fixed_size is not None:
            size = int(np.prod(source.info["shape"]))
            return ((nm, size) for nm in names)
        offsets = np.asarray(source._offsets)
        return zip(names, (offsets[source.rows + 1] - offsets[source.rows]).tolist())
    if isinstance(source, ShardSource):
        shards = [os.path.basename(u).encode() for u in source.urls]
        return ((shards[int(s)] + b":" + k, int(sz)) for s, k, sz in zip(source.shard, source.keys,
                                                                         source.spans[:, 1]))
    return ((source.name(i).encode("utf-8", "surrogateescape"), -1) for i in range(len(source)))
