"""Assembling the input pipeline from a :class:`DataConfig`: open the splits, cache decoded
images in RAM when they fit, pick the batched or per-image path and the worker count, and hand
the trainer an iterator of ``uint8`` batches plus the :class:`DevicePipeline` that finishes them
on the device.

Two paths
- **batched** (in-RAM or packed raw images already at the training size, pad-crop/flip or no
  augmentation): a batch is one gather from a ``(N, 3, H, W)`` array; crop and flip, RandAugment /
  TrivialAugment and random erasing run batched on the device. No worker processes; a background thread keeps ``data.prefetch`` batches ready.
- **per-image** (everything else): worker processes decode and augment each image with
  torchvision.transforms.v2 on ``uint8`` tensors and return whole batches.
Both are deterministic functions of ``(seed, epoch, batch index)`` and resume exactly.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from vitflow.config import DataConfig
from vitflow.data.augment import MixupCutmix
from vitflow.data.augment.policies import POLICIES, BatchPolicy
from vitflow.data.cache import CenterCropSource, cache_in_memory, cache_resolution, in_ram, photo_cache_size
from vitflow.data.decode import CorruptImageError
from vitflow.data.device import DevicePipeline, Prefetcher
from vitflow.data.loader import EpochSampler, epoch_sampler, make_loader
from vitflow.data.remote.fs import RemoteError
from vitflow.data.remote.fs import configure_from as configure_remote
from vitflow.data.sources.base import DataError, FileSource, ImageSource
from vitflow.data.sources.dispatch import open_split, open_training, resolve_eval_splits
from vitflow.data.sources.splits import selection_record
from vitflow.data.stream import StreamBatches
from vitflow.data.transforms import Preprocess, eval_transform, resolve_augment, train_transform
from vitflow.data.wds.stream import ShardStream, shard_loader
from vitflow.runtime import mix_seed

log = logging.getLogger(__name__)


@dataclass
class Datasets:
    """The splits of a run, their class list and the eval preprocessing. ``val`` (evaluated during
    training; it chooses the kept checkpoint and multi-label thresholds) and ``test`` (evaluated
    once at the end) are each optional, not both. Images found unreadable while caching stay in
    their split and are reported by every pass over it."""

    train: ImageSource
    val: ImageSource | None
    test: ImageSource | None
    classes: list[str]
    preprocess: Preprocess
    val_split: str | None = None
    test_split: str | None = None
    task: str = "multiclass"
    # what each split expression selected, by role (train, val, test): the
    # :func:`~vitflow.data.sources.splits.selection_record` a run keeps (none for streamed shards)
    selection: dict[str, dict] = field(default_factory=dict)

    @property
    def monitored(self) -> str:
        """The role of the split evaluated during training: ``"val"``, or ``"test"`` when there is
        no validation split."""
        return "val" if self.val is not None else "test"


def open_datasets(cfg: DataConfig, image_size: int) -> Datasets:
    """Open ``cfg.train_split`` and the validation and test splits (see
    :func:`~vitflow.data.sources.dispatch.resolve_eval_splits`; labelled with the train classes; a test
    split that is the validation split, ``data.test_split=val``, is that same source) and cache
    them in RAM when they fit ``cfg.max_in_memory`` (the training split not in stream access).

    Raises:
        DataError: see :func:`vitflow.data.sources.dispatch.open_split`; a validation or test split that
            selects no images.
    """
    raise_open_file_limit()
    configure_remote(cfg)  # retries and the local cache of remote data (vitflow.data.remote.fs)
    val_split, test_split = resolve_eval_splits(cfg)
    train = open_training(cfg)  # shards train by streaming (data/wds/stream.py)
    streamed = isinstance(train, ShardStream)
    if streamed:
        log.info("%s: %d shard(s), %d samples, %d classes", cfg.train_split, len(train.shards.urls), len(train),
                 len(train.classes))
    held_out = {}
    for key, split in (("val_split", val_split), ("test_split", test_split)):
        if split is not None and not (key == "test_split" and split == val_split):  # the same split: opened once
            try:
                held_out[key] = open_split(cfg.path, split, cfg.source, classes=train.classes, cfg=cfg)
            except DataError as e:  # named by its key (a store's error names its URL already)
                raise e if isinstance(e, RemoteError) else DataError(f"data.{key}={split!r}: {e}") from None
            if len(held_out[key]) == 0:
                raise DataError(f"data.{key}={split!r} selects no images")
    val, test = _val_test(held_out, val_split, test_split)  # (before the RAM cache: file sources name their images)
    selection = {role: selection_record(src, expr) for role, src, expr in
                 (("train", train, cfg.train_split), ("val", val, val_split), ("test", test, test_split))
                 if src is not None and expr is not None and not (role == "train" and streamed)}
    if cfg.max_in_memory > 0:
        crops_resized = resolve_augment(cfg.train_augment, image_size) == "random_resized_crop"
        if cfg.access == "random" and not streamed:
            train = _cache(train, cfg, image_size, "train", crops_resized)
        held_out = {k: _cache(v, cfg, image_size, k[:-6], True, exact=True) for k, v in held_out.items()}
    pp = Preprocess(image_size, cfg.crop_pct, cfg.interpolation, tuple(cfg.mean), tuple(cfg.std))
    val, test = _val_test(held_out, val_split, test_split)
    return Datasets(train, val, test, train.classes, pp, val_split, test_split, cfg.task, selection)


def _val_test(held_out: dict, val_split: str | None, test_split: str | None) -> tuple:
    """The validation and test sources of :func:`open_datasets`' opened splits (by key): the test
    source is the validation one when both name the same split."""
    val = held_out.get("val_split")
    return val, val if test_split is not None and test_split == val_split else held_out.get("test_split")


def _cache(source: ImageSource, cfg: DataConfig, image_size: int, desc: str, resizable: bool,
           exact: bool = False) -> ImageSource:
    """``source`` in the RAM cache when it fits, at the size :func:`~vitflow.data.cache.cache_resolution`
    chooses (the choice and its reason logged); ``exact``: JPEGs decoded in full (evaluated splits)."""
    if len(source) > cfg.max_in_memory or in_ram(source):
        return source
    size, why = cache_resolution(source, cfg.cache_resolution, image_size, cfg.crop_pct, resizable)
    if size is not None:
        if size < image_size:
            raise DataError(f"data.cache_resolution={size} is smaller than model.img_size={image_size}")
        log.info("%s: caching at %dx%d (%s)", desc, size, size, why)
    workers = source.reader_processes(cfg.num_workers)  # a user's dataset: data.num_workers (logged)
    return cache_in_memory(source, cfg.max_in_memory, workers, desc, resize_to=size,
                           interpolation=cfg.interpolation, center_on=image_size if size else None, exact=exact)


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
    """True when ``source`` can take the batched path (see the module docstring): random access,
    no per-image-only augmentation, and images of one fixed size that is the training size
    (``pad_crop``, ``none``) or any size (``random_resized_crop``: the device crops and resizes,
    e.g. a RAM cache at :func:`~vitflow.data.cache.photo_cache_size`). RandAugment, TrivialAugment and
    random erasing run batched too (:mod:`vitflow.data.augment.policies`); AutoAugment and color jitter are
    per-image."""
    augment = resolve_augment(cfg.train_augment, image_size)
    if augment == "random_resized_crop":
        sized = source.fixed_size is not None
    else:
        sized = augment in ("pad_crop", "none") and source.fixed_size == (image_size, image_size)
    return sized and cfg.access == "random" and cfg.auto_augment in ("none", *POLICIES) and cfg.color_jitter == 0


def choose_workers(cfg: DataConfig, source: ImageSource, transform, batched: bool) -> int:
    """``data.num_workers``, or for ``auto``: 0 on the batched path or for a source that cannot go to
    worker processes (:meth:`~vitflow.data.sources.base.ImageSource.worker_problem`); else 0 when a probe shows
    per-image work under 0.2 ms (worker IPC would cost more), otherwise one worker per core
    (at most 8)."""
    if cfg.num_workers != "auto":
        return int(cfg.num_workers)
    if batched or source.worker_problem():  # (a dataset that does not pickle: loaded in this process)
        return 0
    if isinstance(source, ShardStream):  # no random access to probe; photos from shards
        return min(os.cpu_count() or 1, 8)
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
        """Stop the prefetch thread and a shard stream's reader (its spool removed)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if callable(close := getattr(getattr(self.loader, "sampler", None), "close", None)):
            close()

    def device_batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of this loader finished on the device: ``(x, targets)``, the model's input (batched
        crop/flip, :func:`~vitflow.data.transforms.model_input`, Mixup/CutMix; see
        :class:`DevicePipeline`)."""
        return self.pipeline(batch)

    def set_resolution(self, pixels: int | None) -> None:
        """Progressive resizing: resize the batches to ``pixels`` square from the next
        :meth:`device_batch` on (``None``: the loader's own size)."""
        self.pipeline.resolution = pixels

    @property
    def resolution(self) -> int | None:
        return self.pipeline.resolution

    def describe(self) -> str:
        path = "per-image decode/augment" if not self.batched else (
            "batched in-RAM gather + device random-resized-crop/flip" if self.pipeline.resized_crop is not None
            else "batched in-RAM gather + device crop/flip")
        policy = self.pipeline.policy
        if policy is not None:
            path += "".join([f" + {policy.policy}" if policy.policy != "none" else "",
                             f" + random erasing {policy.erasing:g}" if policy.erasing else ""])
        return f"{path}, {self.num_workers} worker(s), prefetch {self.prefetch}{' (thread)' if self.threaded else ''}"


def train_loader(source: ImageSource, cfg: DataConfig, image_size: int, batch_size: int, seed: int,
                 device: torch.device, num_classes: int, start: tuple[int, int] = (0, 0), rank: int = 0,
                 world_size: int = 1, epochs: int | None = None) -> TrainLoader:
    """Training batches of ``batch_size`` images from ``start = (epoch, batch index)``, sharded
    over ``(rank, world_size)``. Every rank shares the epoch order (``seed``); the augmentation
    randomness of the random-access path and the device pipeline is seeded per rank. ``epochs``:
    WebDataset shards are read no further than the end of epoch ``epochs - 1`` (a shuffle buffer
    would otherwise fill from the next epoch's shards: downloads a short run does not use); the
    other sources ignore it (their batches are endless).

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
    if isinstance(source, ShardStream):
        if cfg.sampler == "balanced":
            raise DataError("data.sampler=balanced draws images by class from random access; WebDataset shards are "
                            "streamed (use train.class_weights=FILE instead)")
        loader, per_epoch = shard_loader(source, transform, batch_size, seed, cfg.shuffle_buffer, start,
                                         rank, world_size, workers, cfg.prefetch,
                                         None if cfg.shard_streams == "auto" else int(cfg.shard_streams), epochs)
    elif cfg.access == "stream":
        if not (isinstance(source, FileSource) and source.spans is not None):
            raise DataError("data.access=stream reads a .tar sequentially; data.path is not a tar")
        dataset = StreamBatches(source, transform, batch_size, seed, cfg.shuffle_buffer, start, rank=rank,
                                world_size=world_size)
        kwargs = dict(prefetch_factor=cfg.prefetch, persistent_workers=True) if workers else {}
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                             generator=torch.Generator(), **kwargs)
        per_epoch = dataset.batches_per_epoch
    else:
        sampler = epoch_sampler(cfg.sampler, source.labels, batch_size, seed, start, rank, world_size)
        loader = make_loader(source, transform, sampler, workers, cfg.prefetch, aug_seed)
        per_epoch = sampler.batches_per_epoch
    mix = None
    if cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0:
        mix = MixupCutmix(num_classes, cfg.mixup_alpha, cfg.cutmix_alpha, cfg.mix_prob, cfg.mix_switch_prob)
    resized = batched and augment == "random_resized_crop"  # the device draws the Inception crop per image
    pipeline = DevicePipeline(device, cfg.mean, cfg.std, aug_seed, (cfg.padding if augment == "pad_crop" else 0)
                              if batched and not resized else None, cfg.hflip, mix, host_threads=1 if workers else None,
                              resized_crop=(image_size, tuple(cfg.scale), (3 / 4, 4 / 3)) if resized else None,
                              interpolation=cfg.interpolation,
                              policy=BatchPolicy(cfg.auto_augment, cfg.random_erasing) if batched else None)
    threaded = workers > 0 or batched  # never with 0 workers per-image: it seeds the global RNG per batch
    return TrainLoader(loader, pipeline, device, cfg.prefetch, threaded, workers, batched, per_epoch)


def eval_loader(source: ImageSource, pp: Preprocess, batch_size: int, num_workers: int | str = 0):
    """One pass over ``source`` in order with the eval transform, last batch short.

    When ``source`` has a fixed size whose shorter side is already the eval resize
    (:func:`~vitflow.data.cache.photo_cache_size`, e.g. a RAM cache made with that ``resize_to``),
    the eval transform is only ``CenterCrop(image_size)``: it is taken as a slice of the batched
    gather (:class:`~vitflow.data.cache.CenterCropSource`; bit-equal to ``eval_transform(pp)`` of
    each cached image), no workers, no resampling; at ``image_size`` itself, a plain gather.
    """
    sampler = EpochSampler(len(source), batch_size, shuffle=False, drop_last=False, epochs=1)
    size = source.fixed_size
    gather = size is not None and min(size) == photo_cache_size(pp.image_size, pp.crop_pct)
    if gather and size != (pp.image_size, pp.image_size):
        source = CenterCropSource(source, pp.image_size)
    workers = 0 if gather or num_workers == "auto" and (in_ram(source) or source.worker_problem()) else (
        min(os.cpu_count() or 1, 8) if num_workers == "auto" else int(num_workers))
    return make_loader(source, None if gather else eval_transform(pp), sampler, workers)
