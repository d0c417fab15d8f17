"""Assembling the input pipeline from a :class:`DataConfig`: open the splits, cache decoded
images in RAM when they fit, pick the batched or per-image path and the worker count, and hand
the trainer an iterator of ``uint8`` batches plus the :class:`DevicePipeline` that finishes them
on the device.

Two paths
- **batched** (in-RAM or packed raw images already at the training size, pad-crop/flip or no
  augmentation): a batch is one gather from a ``(N, 3, H, W)`` array; crop and flip run batched
  on the device. No worker processes; a background thread keeps ``data.prefetch`` batches ready.
- **per-image** (everything else): worker processes decode and augment each image with
  torchvision.transforms.v2 on ``uint8`` tensors and return whole batches.
Both are deterministic functions of ``(seed, epoch, batch index)`` and resume exactly.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.augment import MixupCutmix
from vitflow.data.decode import CorruptImageError
from vitflow.data.device import DevicePipeline, Prefetcher
from vitflow.data.loader import EpochSampler, make_loader, mix_seed
from vitflow.data.packed import PackedSource, encode_images
from vitflow.data.sources import DataError, FileSource, ImageSource, TensorSource, open_split
from vitflow.data.stream import StreamBatches
from vitflow.data.transforms import Preprocess, eval_transform, resolve_augment, train_transform

log = logging.getLogger(__name__)


@dataclass
class Datasets:
    """The train and test splits of a run, their class list and the eval preprocessing. Images
    found unreadable while caching stay in their split and are reported by every pass over it."""

    train: ImageSource
    test: ImageSource
    classes: list[str]
    preprocess: Preprocess


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


def _in_ram(source: ImageSource) -> bool:
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
    if _in_ram(source) or len(source) == 0 or len(source) > max_images:
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


def open_datasets(cfg: DataConfig, image_size: int) -> Datasets:
    """Open ``cfg.train_split`` and ``cfg.test_split`` (the test split labelled with the train
    classes) and cache them in RAM when they fit ``cfg.max_in_memory`` (not in stream access).

    Raises:
        DataError: see :func:`vitflow.data.sources.open_split`.
    """
    raise_open_file_limit()
    train = open_split(cfg.path, cfg.train_split, cfg.source)
    test = open_split(cfg.path, cfg.test_split, cfg.source, classes=train.classes)
    if len(test) == 0:
        raise DataError(f"data.test_split={cfg.test_split!r} selects no images")
    if cfg.max_in_memory > 0:
        workers = os.cpu_count() or 1
        if cfg.access == "random":
            train = cache_in_memory(train, cfg.max_in_memory, workers, "train")
        test = cache_in_memory(test, cfg.max_in_memory, workers, "test")
    pp = Preprocess(image_size, cfg.crop_pct, cfg.interpolation, tuple(cfg.mean), tuple(cfg.std))
    return Datasets(train, test, train.classes, pp)


def raise_open_file_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (many workers and files open at once
    otherwise fail with 'Too many open files'). Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft


def is_batched(source: ImageSource, cfg: DataConfig, image_size: int) -> bool:
    """True when ``source`` can take the batched path (see the module docstring)."""
    return (source.fixed_size == (image_size, image_size) and cfg.access == "random"
            and resolve_augment(cfg.train_augment, image_size) in ("pad_crop", "none")
            and cfg.auto_augment == "none" and cfg.color_jitter == 0 and cfg.random_erasing == 0)


def choose_workers(cfg: DataConfig, source: ImageSource, transform, batched: bool) -> int:
    """``data.num_workers``, or for ``auto``: 0 on the batched path; else 0 when a probe shows
    per-image work under 0.2 ms (worker IPC would cost more), otherwise one worker per core
    (at most 8)."""
    if cfg.num_workers != "auto":
        return int(cfg.num_workers)
    if batched:
        return 0
    t0, n = time.perf_counter(), min(32, len(source))
    with torch.random.fork_rng(devices=[]):  # the probe's random crops must not move the model's RNG
        for i in range(n):
            try:
                transform(source.load(i))
            except CorruptImageError:
                pass
    per_image = (time.perf_counter() - t0) / max(n, 1)
    workers = 0 if per_image < 2e-4 else min(os.cpu_count() or 1, 8)
    log.debug("data.num_workers=auto: %d (probe: %.3f ms per image over %d images; workers from 0.2 ms)",
              workers, per_image * 1e3, n)
    return workers


class TrainLoader:
    """Endless training batches (``uint8`` images on the host, or on CUDA when prefetched) and
    the :class:`DevicePipeline` that turns them into model input.

    Attributes:
        pipeline: the device-side step (crop/flip when batched, normalise, Mixup/CutMix).
        num_workers: loader processes used; ``batched``: which path was taken.
        batches_per_epoch: batches of one epoch on this rank (batch ``index`` runs 0 .. this - 1).
    """

    def __init__(self, loader, pipeline: DevicePipeline, device: torch.device, prefetch: int, threaded: bool,
                 num_workers: int, batched: bool, batches_per_epoch: int):
        self.loader, self.pipeline, self.device, self.prefetch = loader, pipeline, device, prefetch
        self.threaded, self.num_workers, self.batched = threaded, num_workers, batched
        self.batches_per_epoch = batches_per_epoch
        self._prefetcher: Prefetcher | None = None

    def __iter__(self):
        if self.threaded:
            self._prefetcher = Prefetcher(self.loader, self.device, self.prefetch)
            return self._prefetcher
        return iter(self.loader)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

    def describe(self) -> str:
        path = "batched in-RAM gather + device crop/flip" if self.batched else "per-image decode/augment"
        return f"{path}, {self.num_workers} worker(s), prefetch {self.prefetch}{' (thread)' if self.threaded else ''}"


def train_loader(source: ImageSource, cfg: DataConfig, image_size: int, batch_size: int, seed: int,
                 device: torch.device, num_classes: int, start: tuple[int, int] = (0, 0), rank: int = 0,
                 world_size: int = 1) -> TrainLoader:
    """Training batches of ``batch_size`` images from ``start = (epoch, batch index)``, sharded
    over ``(rank, world_size)``. Every rank shares the epoch order (``seed``); the augmentation
    randomness of the random-access path and the device pipeline is seeded per rank.

    Raises:
        DataError: stream access on a source that is not a tar.
    """
    batched = is_batched(source, cfg, image_size)
    augment = resolve_augment(cfg.train_augment, image_size)
    transform = None if batched else train_transform(
        image_size, augment, cfg.scale, cfg.padding, cfg.hflip, cfg.interpolation, cfg.auto_augment,
        cfg.color_jitter, cfg.random_erasing)
    workers = choose_workers(cfg, source, transform, batched)
    aug_seed = seed if world_size == 1 else mix_seed(seed, rank, world_size)
    if cfg.access == "stream":
        if not (isinstance(source, FileSource) and source.spans is not None):
            raise DataError("data.access=stream reads a .tar sequentially; data.path is not a tar")
        dataset = StreamBatches(source, transform, batch_size, seed, cfg.shuffle_buffer, start, rank=rank,
                                world_size=world_size)
        kwargs = dict(prefetch_factor=cfg.prefetch, persistent_workers=True) if workers else {}
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                             generator=torch.Generator(), **kwargs)
        per_epoch = dataset.batches_per_epoch
    else:
        sampler = EpochSampler(len(source), batch_size, shuffle=True, drop_last=True, seed=seed, start=start,
                               rank=rank, world_size=world_size)
        loader = make_loader(source, transform, sampler, workers, cfg.prefetch, aug_seed)
        per_epoch = sampler.batches_per_epoch
    mix = None
    if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
        mix = MixupCutmix(num_classes, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.mix_prob, cfg.mix_switch_prob)
    pipeline = DevicePipeline(device, cfg.mean, cfg.std, aug_seed, (cfg.padding if augment == "pad_crop" else 0)
                              if batched else None, cfg.hflip, mix, host_threads=1 if workers else None)
    threaded = workers > 0 or batched  # never with 0 workers per-image: it seeds the global RNG per batch
    return TrainLoader(loader, pipeline, device, cfg.prefetch, threaded, workers, batched, per_epoch)


def eval_loader(source: ImageSource, pp: Preprocess, batch_size: int, num_workers: int | str = 0):
    """One pass over ``source`` in order with the eval transform (a plain gather when the images
    are already at the eval size), last batch short."""
    sampler = EpochSampler(len(source), batch_size, shuffle=False, drop_last=False, epochs=1)
    identity = source.fixed_size == (pp.image_size, pp.image_size) and pp.crop_pct == 1.0
    workers = 0 if identity or num_workers == "auto" and _in_ram(source) else (
        min(os.cpu_count() or 1, 8) if num_workers == "auto" else int(num_workers))
    return make_loader(source, None if identity else eval_transform(pp), sampler, workers)
