"""The ``data`` section of the configuration: where the images are, how they are split, read,
augmented and batched (:class:`DataConfig`). Pure data, like the rest of :mod:`vitflow.config`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from vitflow.config.checks import check as _check

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class DataConfig:
    """Where images come from and how they become batches."""

    # auto (the kind detected from data.path) or the name of a source kind (checked against the table of
    # vitflow.data.sources.table)
    source: str = "auto"
    # where the data is: a path or URL of one of data.source's kinds (an image folder, a .tar of one, a label file,
    # a Hugging Face dataset, a packed dataset, CIFAR batches, shards, ...)
    path: str | None = None
    task: Literal["multiclass", "multilabel"] = "multiclass"  # multilabel: any number of labels per image
    train_split: str = "train"  # a split name with an optional slice: train[:98%]
    # evaluated during training; chooses the kept checkpoint and multi-label thresholds.
    # auto: the data's val / valid / validation split if it has one; none: no validation split
    val_split: str = "auto"
    # evaluated once, at the end of training (during it too when there is no validation split).
    # auto: the data's test split if it has one; none: no test split
    test_split: str = "auto"
    # named evaluation splits, each evaluated at every evaluation and logged as NAME_top1 ...: name:split,name2:split2
    evals: str | None = None
    root: str | None = None  # label files: the folder image paths are relative to (default: the file's folder)
    image_column: str = "auto"  # label files / HF datasets: auto = image, path, file, filename, file_name, ... or img
    label_column: str = "auto"  # label files / HF datasets: auto = label, labels, class, category, target or tags
    split_column: str = "auto"  # label files: auto = a column named split, if any (values: train, val, test...)
    classes: str | None = None  # a text file of class names, one per line (default: the data's own)
    label_separator: str = ";"  # multilabel: separator of several labels in one cell (or a JSON list)
    # fixes that leave the files alone, applied in every split (vitflow inspect writes both): a text file of images
    # to drop, one per line (a path relative to the data's root, a tar member name or a full path), and a CSV of
    # path,label rows giving images another class; an image in both is relabelled
    exclude: str | None = None
    relabel: str | None = None
    # training crops: auto = pad_crop up to 64 px, else random_resized_crop
    train_augment: Literal["auto", "random_resized_crop", "pad_crop", "none"] = "auto"
    scale: tuple[float, float] = (0.08, 1.0)  # random_resized_crop area range
    padding: int = 4  # pad_crop padding in pixels
    hflip: bool = True  # random horizontal flips in training
    crop_pct: float = 0.875  # eval: resize to model.img_size / crop_pct, then center crop
    interpolation: Literal["bilinear", "bicubic"] = "bicubic"  # resizing filter
    mean: tuple[float, float, float] = IMAGENET_MEAN  # normalisation, per channel, 0..1 scale
    std: tuple[float, float, float] = IMAGENET_STD  # normalisation, per channel, 0..1 scale
    # config: data.mean / data.std as set (by the preset, the pretrained weights or you); dataset: the training
    # split's own, measured once (vitflow prepare --stats, else at the start of training) and stored beside the data
    normalize: Literal["config", "dataset"] = "config"
    # per-image policy: RandAugment (2 ops, magnitude 9), TrivialAugmentWide, AutoAugment (ImageNet)
    auto_augment: Literal["none", "randaugment", "trivialaugment", "autoaugment"] = "none"
    color_jitter: float = 0.0  # brightness/contrast/saturation strength
    random_erasing: float = 0.0  # probability per image
    mixup_alpha: float = 0.0  # Beta(a, a); 0 = off (batched on the device, soft targets)
    cutmix_alpha: float = 0.0  # Beta(a, a) of CutMix boxes; 0 = off
    mix_prob: float = 1.0  # probability a batch is mixed
    mix_switch_prob: float = 0.5  # CutMix instead of Mixup when both are on
    progressive_min_size: int | None = None  # progressive resizing: start resolution in px (None = off)
    progressive_ramp: tuple[float, float] = (0.0, 0.6)  # fractions of the run over which it rises to full
    num_workers: int | Literal["auto"] = "auto"  # auto: 0 on the batched path, else a probe decides
    prefetch: int = 2  # batches kept ready (per worker; and by the background thread)
    max_in_memory: int = 200_000  # decode a split into RAM once if it has at most this many images
    # the RAM cache's image size: auto = photos of varied or large sizes resized to model.img_size / crop_pct
    # (short side, then center crop) on the way in, which gives them the batched path; full = as decoded; or pixels
    cache_resolution: int | Literal["auto", "full"] = "auto"
    access: Literal["random", "stream"] = "random"  # stream: read a tar in order through a shuffle buffer
    shuffle_buffer: int = 50_000  # images, for access=stream and shards (per stream; capped at its size)
    # shards: streams an epoch is cut into, each read in order through its own shuffle buffer; auto = one per rank.
    # Fixed (a multiple of the rank count), the order is the same on any rank count dividing it
    shard_streams: int | Literal["auto"] = "auto"
    eval_batch_size: int | None = None  # None = the training micro-batch
    # remote data (s3://, gs://, https://, hf://): a local folder keeping whole shards / files read
    # sequentially, and its size bound (500MB, 20GiB; None = unbounded; least recently used go first)
    cache_dir: str | None = None
    cache_max_size: str | None = None
    remote_retries: int = 5  # attempts after the first on transient remote errors (5xx, 429, resets)
    remote_backoff: float = 1.0  # seconds: the first wait between attempts, doubled each time (with jitter)
    # training order: random = a permutation per epoch; balanced = every class equally often (classes drawn
    # uniformly, then an image of the class, with replacement; Kang et al. 2020). Multiclass, data.access=random
    sampler: Literal["random", "balanced"] = "random"

    def validate(self) -> None:
        _check(self.source != "digits" or self.path in (None, "digits"), "data.path", self.path,
               "unset with data.source=digits (the embedded data); for your images also set data.source=auto")
        _check(0 < self.scale[0] <= self.scale[1] <= 1, "data.scale", self.scale, "0 < min <= max <= 1")
        _check(self.padding >= 0, "data.padding", self.padding, ">= 0")
        _check(0 < self.crop_pct <= 1, "data.crop_pct", self.crop_pct, "in (0, 1]")
        _check(all(s > 0 for s in self.std), "data.std", self.std, "all > 0")
        _check(self.num_workers == "auto" or self.num_workers >= 0, "data.num_workers", self.num_workers,
               ">= 0 or auto")
        _check(self.prefetch >= 1, "data.prefetch", self.prefetch, ">= 1")
        _check(self.max_in_memory >= 0, "data.max_in_memory", self.max_in_memory, ">= 0")
        _check(self.cache_resolution in ("auto", "full") or self.cache_resolution > 0, "data.cache_resolution",
               self.cache_resolution, "auto, full or a size in pixels > 0")
        _check(self.progressive_min_size is None or self.progressive_min_size > 0, "data.progressive_min_size",
               self.progressive_min_size, "> 0")
        _check(0 <= self.progressive_ramp[0] <= self.progressive_ramp[1] <= 1, "data.progressive_ramp",
               self.progressive_ramp, "0 <= start <= end <= 1")
        _check(self.shuffle_buffer >= 1, "data.shuffle_buffer", self.shuffle_buffer, ">= 1")
        _check(self.shard_streams == "auto" or self.shard_streams >= 1, "data.shard_streams", self.shard_streams,
               ">= 1 or auto")
        for key in ("color_jitter", "mixup_alpha", "cutmix_alpha"):
            _check(getattr(self, key) >= 0, f"data.{key}", getattr(self, key), ">= 0")
        for key in ("random_erasing", "mix_prob", "mix_switch_prob"):
            _check(0 <= getattr(self, key) <= 1, f"data.{key}", getattr(self, key), "in [0, 1]")
        _check(self.eval_batch_size is None or self.eval_batch_size > 0, "data.eval_batch_size",
               self.eval_batch_size, "> 0")
        _check(len(self.label_separator) > 0, "data.label_separator", self.label_separator, "not empty")
        _check(self.cache_max_size is None or re.fullmatch(r"\s*\d+(\.\d+)?\s*([KMGT]i?B?|B)?\s*", str(
               self.cache_max_size), re.I) is not None, "data.cache_max_size", self.cache_max_size,
               "a size such as 500MB or 20GiB")
        _check(self.remote_retries >= 0, "data.remote_retries", self.remote_retries, ">= 0")
        _check(self.remote_backoff >= 0, "data.remote_backoff", self.remote_backoff, ">= 0 seconds")
        _check(self.sampler == "random" or (self.access == "random" and self.task == "multiclass"), "data.sampler",
               self.sampler, "random with data.access=stream or data.task=multilabel")
