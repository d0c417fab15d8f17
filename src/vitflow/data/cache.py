"""The RAM cache: a split decoded once, in parallel, at start-up, when it fits.

Unreadable images keep their place and raise :class:`~vitflow.data.decode.CorruptImageError`
with the reason found while caching whenever they are loaded, so every pass skips, reports and
counts them exactly as it would reading the files.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError
from vitflow.data.encode import encode_images
from vitflow.data.packed import PackedSource
from vitflow.data.sources import DataError, ImageSource, TensorSource

log = logging.getLogger(__name__)


class ListSource(ImageSource):
    """Decoded images of different sizes kept in RAM (a list of ``uint8 (3, H, W)`` tensors) for
    rows ``rows`` of ``base``. An image that could not be decoded is ``None`` and its reason is in
    ``errors`` (by base row): loading it raises CorruptImageError, as reading the file would."""

    def __init__(self, base: ImageSource, images: list[torch.Tensor | None], rows: np.ndarray,
                 errors: dict[int, str] | None = None):
        self.classes, self.labels, self.base, self.images, self.rows = base.classes, base.labels[rows], base, images, rows
        self.errors = errors or {}

    def name(self, i: int) -> str:
        return self.base.name(int(self.rows[i]))

    def load(self, i: int) -> torch.Tensor:
        image = self.images[i]
        if image is None:
            raise CorruptImageError(self.name(i), self.errors[int(self.rows[i])])
        return image

    def subset(self, idx: np.ndarray) -> "ListSource":
        return ListSource(self.base, [self.images[i] for i in idx], self.rows[np.asarray(idx)], self.errors)


def in_ram(source: ImageSource) -> bool:
    """True when ``source``'s images are decoded in memory (or memory-mapped raw pixels)."""
    return isinstance(source, (TensorSource, ListSource)) or (isinstance(source, PackedSource) and
                                                             source.fixed_size is not None)


def cache_in_memory(source: ImageSource, max_images: int, workers: int = 1, desc: str = "cache") -> ImageSource:
    """Decode every image of ``source`` once into RAM when it has at most ``max_images`` images
    and their decoded size (estimated from the first 32) fits in a quarter of physical memory.

    Unreadable images keep their place (same length, order and labels as ``source``): loading one
    raises CorruptImageError with the reason found while caching, so every epoch and every
    evaluation skips, reports and counts it exactly as it would reading the files.

    Returns:
        A :class:`TensorSource` when all readable images share one size, else a
        :class:`ListSource`; or ``source`` unchanged when it is already in RAM or does not fit.
    Raises:
        DataError: no image of ``source`` is readable.
    """
    if in_ram(source) or len(source) == 0 or len(source) > max_images:
        return source
    probe = []
    for i in range(min(32, len(source))):
        try:
            probe.append(source.load(i).numel())
        except CorruptImageError:
            pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if probe and np.mean(probe) * len(source) > ram / 4:
        log.info("%s: %d images (~%.1f GB decoded) do not fit the RAM cache", desc, len(source),
                 np.mean(probe) * len(source) / 1e9)
        return source
    t0 = time.perf_counter()
    images: list = [None] * len(source)
    errors: dict[int, str] = {}
    for i, arr, err in encode_images(source, "raw", None, 0, workers, desc):
        if arr is None:
            errors[i] = err
        else:
            images[i] = torch.from_numpy(arr)
    kept = [im for im in images if im is not None]
    if not kept:
        raise DataError(f"{desc}: no readable image")
    log.info("%s: %d images decoded into RAM in %.1f s%s", desc, len(kept), time.perf_counter() - t0,
             f" ({len(errors)} unreadable, reported when read)" if errors else "")
    if len({tuple(t.shape) for t in kept}) == 1:
        blank = torch.zeros_like(kept[0])  # the row of an unreadable image; never delivered
        stacked = torch.stack([blank if im is None else im for im in images])
        return TensorSource(source.classes, source.labels, stacked, desc, base=source, errors=errors)
    return ListSource(source, images, np.arange(len(source)), errors)
