"""The RAM cache: a split decoded once, in parallel, at start-up, when it fits; photos of varied
sizes optionally resized to one square size on the way in (:func:`photo_cache_size`), which gives
them the batched path (:mod:`vitflow.data.pipeline`).

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
from vitflow.data.encode import center_offset, encode_images
from vitflow.data.sources.base import DataError, ImageSource, TensorSource
from vitflow.data.sources.packed import PackedSource

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
    if isinstance(source, CenterCropSource):
        return in_ram(source.base)
    return isinstance(source, (TensorSource, ListSource)) or (isinstance(source, PackedSource) and
                                                             source.fixed_size is not None)


def photo_cache_size(image_size: int, crop_pct: float) -> int:
    """The square size ``R`` to cache photos of varied sizes at for a model of ``image_size``:
    ``round(image_size / crop_pct)``, the eval transform's resize (256 for 224 at 0.875).

    ``cache_in_memory(split, ..., resize_to=R, interpolation=cfg.interpolation,
    center_on=image_size)`` then gives a :class:`TensorSource` of ``R x R`` images on which
    evaluation is a plain center crop of ``image_size`` (bit-equal to ``eval_transform`` of the
    file for images decoded in full) and training a batched random-resized crop on the device
    (:func:`vitflow.data.pipeline.is_batched`). Training crops then come from the central square
    of each photo at ``R`` px (a 4:3 photo loses 1/8 of its width on each side).
    """
    return int(round(image_size / crop_pct))


def cache_resolution(source: ImageSource, setting: int | str, image_size: int, crop_pct: float,
                     resizable: bool = True) -> tuple[int | None, str]:
    """The square size to cache ``source`` at (``None``: as decoded) and why, for
    ``data.cache_resolution=setting``.

    ``"full"``: ``None``. An int: that size. ``"auto"``: :func:`photo_cache_size` when ``resizable``
    (the split is evaluated, or trained with random-resized crops, which start from any size) and
    the headers of 32 of its images (spread over it) show photos that differ in size or whose shorter side is
    over that size — decoded as they are they would need the per-image path (or far more RAM) —
    else ``None`` (images already in RAM, or all of one size the model can take as it is).
    """
    if setting == "full":
        return None, "data.cache_resolution=full"
    if not isinstance(setting, str):
        return int(setting), f"data.cache_resolution={setting}"
    target = photo_cache_size(image_size, crop_pct)
    if not resizable or in_ram(source) or len(source) == 0:
        return None, "images kept as decoded"
    sizes = set(source.sample_sizes(32))  # spread over the split: a folder sorted by class may start uniform
    if not sizes:
        return None, "no readable image among 32 sampled"
    if len(sizes) > 1:
        return target, (f"photos of {len(sizes)} sizes among 32 sampled: one size gives the batched in-RAM path "
                        f"(the eval resize, {image_size} px / crop_pct {crop_pct:g})")
    w, h = next(iter(sizes))
    if min(w, h) > target:
        return target, f"{w}x{h} images, larger than the eval resize ({target} px): decoded smaller, they take less RAM"
    return None, f"all {w}x{h}: kept as decoded"


def cache_in_memory(source: ImageSource, max_images: int, workers: int = 1, desc: str = "cache",
                    resize_to: int | None = None, interpolation: str = "bicubic",
                    center_on: int | None = None, exact: bool = False) -> ImageSource:
    """Decode every image of ``source`` once into RAM when it has at most ``max_images`` images
    and their decoded size (estimated from the first 32, or ``3 * R * R`` bytes each when resized)
    fits in a quarter of physical memory.

    With ``resize_to=R`` each image is decoded (in the worker processes, JPEGs at a reduced DCT
    scale when that keeps ``R``) with its shorter side resized to ``R`` (antialiased
    ``interpolation``: the eval transform's resize) and center-cropped to ``R x R``; ``center_on``
    (the eval crop size) aligns that crop to the eval transform's center crop
    (:func:`~vitflow.data.encode.load_square`); ``exact`` decodes every JPEG in full (an evaluated
    split: its cached pixels are then the eval transform's of the files, and its figures those of
    ``vitflow eval``, which reads the files). See :func:`photo_cache_size`.

    Unreadable images keep their place (same length, order and labels as ``source``): loading one
    raises CorruptImageError with the reason found while caching, so every epoch and every
    evaluation skips, reports and counts it exactly as it would reading the files.

    Returns:
        A :class:`TensorSource` when all readable images share one size (always with
        ``resize_to``: ``(n, 3, R, R)``), else a :class:`ListSource`; or ``source`` unchanged
        when it is already in RAM (``resize_to`` too) or does not fit.
    Raises:
        DataError: no image of ``source`` is readable.
    """
    if in_ram(source) or len(source) == 0 or len(source) > max_images:
        return source
    per_image = 3 * resize_to * resize_to if resize_to else _probe_bytes(source)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if per_image * len(source) > ram / 4:
        log.info("%s: %d images (~%.1f GB decoded) do not fit the RAM cache", desc, len(source),
                 per_image * len(source) / 1e9)
        return source
    t0 = time.perf_counter()
    images: list = [None] * len(source)
    errors: dict[int, str] = {}
    kind, square = ("resized", (resize_to, interpolation, center_on, exact)) if resize_to else ("raw", None)
    for i, arr, err in encode_images(source, kind, None, 0, workers, desc, square):
        if arr is None:
            errors[i] = err
        else:
            images[i] = torch.from_numpy(arr)
    kept = [im for im in images if im is not None]
    if not kept:
        raise DataError(f"{desc}: no readable image")
    how = f" at {resize_to}x{resize_to} (short side resized, center crop)" if resize_to else ""
    log.info("%s: %d images decoded into RAM%s in %.1f s%s", desc, len(kept), how, time.perf_counter() - t0,
             f" ({len(errors)} unreadable, reported when read)" if errors else "")
    if len({tuple(t.shape) for t in kept}) == 1:
        blank = torch.zeros_like(kept[0])  # the row of an unreadable image; never delivered
        stacked = torch.stack([blank if im is None else im for im in images])
        return TensorSource(source.classes, source.labels, stacked, desc, base=source, errors=errors)
    return ListSource(source, images, np.arange(len(source)), errors)


def _probe_bytes(source: ImageSource) -> float:
    """Mean decoded bytes of the readable images among the first 32 of ``source`` (0 if none)."""
    probe = []
    for i in range(min(32, len(source))):
        try:
            probe.append(source.load(i).numel())
        except CorruptImageError:
            pass
    return float(np.mean(probe)) if probe else 0.0


class CenterCropSource(ImageSource):
    """The central ``size x size`` of every image of ``base``, a fixed-size source (e.g. a RAM
    cache at :func:`photo_cache_size`): ``CenterCrop(size)`` as torchvision anchors it, taken as a
    slice of the batched gather (no resampling, no per-image work).

    ``load(i)``: ``uint8 (3, size, size)``; ``load_batch(idx)``: ``uint8 (B, 3, size, size)``,
    contiguous. Names, labels and unreadable images are ``base``'s.

    Raises:
        ValueError: ``base`` has no fixed size, or one smaller than ``size``.
    """

    def __init__(self, base: ImageSource, size: int):
        if base.fixed_size is None or min(base.fixed_size) < size:
            raise ValueError(f"cannot center-crop {size}x{size} from images of size {base.fixed_size}")
        h, w = base.fixed_size
        self.base, self.classes, self.labels, self.fixed_size = base, base.classes, base.labels, (size, size)
        self.top, self.left = center_offset(h, size), center_offset(w, size)

    def _crop(self, images: torch.Tensor) -> torch.Tensor:
        s = self.fixed_size[0]
        return images[..., self.top:self.top + s, self.left:self.left + s]

    def name(self, i: int) -> str:
        return self.base.name(i)

    def load(self, i: int) -> torch.Tensor:
        return self._crop(self.base.load(i))

    def load_batch(self, idx: np.ndarray) -> torch.Tensor:
        if isinstance(self.base, TensorSource):  # one gather of just the window's pixels
            return self._crop(self.base.images)[torch.from_numpy(np.asarray(idx, dtype=np.int64))]
        return self._crop(self.base.load_batch(idx)).contiguous()

    def known_unreadable(self, idx: np.ndarray) -> tuple[np.ndarray, list[tuple[str, str]]]:
        return self.base.known_unreadable(idx)

    def subset(self, idx: np.ndarray) -> "CenterCropSource":
        return CenterCropSource(self.base.subset(idx), self.fixed_size[0])
