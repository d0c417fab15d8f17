"""Data layer: sources (folder, tar, label file, Hugging Face, packed, CIFAR batches, shards,
embedded digits: one record per kind in one table, which one dispatch module reads to pick the
kind for a path) -> epoch sampler or stream -> decode + augment (per image in workers, or batched)
-> ``uint8`` batches -> finished on the device (crop/flip, normalise, Mixup/CutMix).
:func:`model_input` is the one conversion of ``uint8`` images into a model's input."""

from vitflow.data.cache import cache_in_memory
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.device import DevicePipeline, Prefetcher
from vitflow.data.loader import EpochSampler, SkipReport, make_loader
from vitflow.data.pipeline import Datasets, TrainLoader, eval_loader, open_datasets, train_loader
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.dispatch import open_split
from vitflow.data.sources.table import check_config
from vitflow.data.transforms import Preprocess, eval_transform, model_input, train_transform

__all__ = ["CorruptImageError", "DataError", "Datasets", "DevicePipeline", "EpochSampler", "ImageSource",
           "Prefetcher", "Preprocess", "SkipReport", "TrainLoader", "cache_in_memory", "check_config", "decode_image",
           "eval_loader", "eval_transform", "make_loader", "model_input", "open_datasets", "open_split",
           "train_loader", "train_transform"]
