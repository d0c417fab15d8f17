"""Data layer: sources (folder, tar, embedded digits) -> epoch sampler -> decode + augment in
workers -> ``uint8`` batches -> normalised on the device."""

from __future__ import annotations

from dataclasses import dataclass

from vitflow.config import DataConfig
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.loader import EpochSampler, SkipReport, make_loader
from vitflow.data.sources import DataError, ImageSource, open_split
from vitflow.data.transforms import Preprocess, eval_transform, normalize, train_transform

__all__ = ["CorruptImageError", "DataError", "Datasets", "EpochSampler", "ImageSource", "Preprocess",
           "SkipReport", "decode_image", "eval_loader", "normalize", "open_datasets", "open_split",
           "train_loader"]


@dataclass
class Datasets:
    """The train and test splits of a run, their class list and the eval preprocessing."""

    train: ImageSource
    test: ImageSource
    classes: list[str]
    preprocess: Preprocess


def open_datasets(cfg: DataConfig, image_size: int) -> Datasets:
    """Open ``cfg.train_split`` and ``cfg.test_split`` (test labelled with the train classes).

    Raises:
        DataError: see :func:`vitflow.data.sources.open_split`.
    """
    train = open_split(cfg.path, cfg.train_split, cfg.source)
    test = open_split(cfg.path, cfg.test_split, cfg.source, classes=train.classes)
    if len(test) == 0:
        raise DataError(f"data.test_split={cfg.test_split!r} selects no images")
    pp = Preprocess(image_size, cfg.crop_pct, cfg.interpolation, tuple(cfg.mean), tuple(cfg.std))
    return Datasets(train, test, train.classes, pp)


def train_loader(source: ImageSource, cfg: DataConfig, image_size: int, batch_size: int, seed: int,
                 start: tuple[int, int] = (0, 0), pin_memory: bool = False):
    """Endless shuffled training batches of ``batch_size`` ``uint8`` images, starting at
    ``start = (epoch, batch index)``. Returns ``(loader, sampler)``."""
    sampler = EpochSampler(len(source), batch_size, shuffle=True, drop_last=True, seed=seed, start=start)
    tf = train_transform(image_size, cfg.train_augment, cfg.scale, cfg.padding, cfg.hflip, cfg.interpolation)
    return make_loader(source, tf, sampler, cfg.num_workers, cfg.prefetch, seed, pin_memory), sampler


def eval_loader(source: ImageSource, pp: Preprocess, batch_size: int, num_workers: int = 0,
                pin_memory: bool = False):
    """One pass over ``source`` in order with the eval transform, last batch short."""
    sampler = EpochSampler(len(source), batch_size, shuffle=False, drop_last=False, epochs=1)
    return make_loader(source, eval_transform(pp), sampler, num_workers, pin_memory=pin_memory)
