"""Data layer: sources (folder, tar, packed, CIFAR batches, embedded digits) -> epoch sampler or
stream -> decode + augment (per image in workers, or batched) -> ``uint8`` batches -> finished on
the device (crop/flip, normalise, Mixup/CutMix)."""

from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.device import DevicePipeline, Prefetcher
from vitflow.data.loader import EpochSampler, SkipReport, make_loader
from vitflow.data.pipeline import Datasets, TrainLoader, cache_in_memory, eval_loader, open_datasets, train_loader
from vitflow.data.sources import DataError, ImageSource, open_split
from vitflow.data.transforms import Preprocess, eval_transform, normalize, train_transform

__all__ = ["CorruptImageError", "DataError", "Datasets", "DevicePipeline", "EpochSampler", "ImageSource",
           "Prefetcher", "Preprocess", "SkipReport", "TrainLoader", "cache_in_memory", "decode_image",
           "eval_loader", "eval_transform", "make_loader", "normalize", "open_datasets", "open_split", "train_loader",
           "train_transform"]
