"""A training recipe planned from the data and the machine, for ``vitflow train data.path=PHOTOS``
with no preset (or ``--preset photos-auto``).

:func:`profile_data` looks at the training split (image count, classes, the typical size from
the headers of a sample) and :func:`plan_overrides` chooses the image size, patch size, model,
batch size, learning rate, warmup and step count, each with the reason, as ``key=value``
overrides that come before the user's own (which always win). :func:`size_warnings` warns, for
any run, when the tokens per image or the input size are far above what the images hold.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from vitflow.config import Config, DataConfig, ModelConfig, build_config, field_names, to_yaml
from vitflow.data import DataError
from vitflow.data.remote.fs import configure_from as configure_remote
from vitflow.data.sources.dispatch import open_training
from vitflow.data.sources.table import reads_path
from vitflow.models import config_class, family_of, model_kwargs
from vitflow.runtime import resolve_device

log = logging.getLogger(__name__)

PHOTO_PRESET = "photos-auto"
SAMPLE = 64  # images whose headers give the typical size


@dataclass(frozen=True)
class DataProfile:
    """What the plan needs to know of the training split: ``images``, ``classes`` and the median
    ``short_side`` / ``long_side`` in pixels of a sample of :data:`SAMPLE` images."""

    images: int
    classes: int
    short_side: int
    long_side: int


def profile_data(d: DataConfig) -> DataProfile:
    """Open the training split of the data section ``d`` and read the sizes of up to :data:`SAMPLE` images
    spread over it (from the encoded headers; decoded sources give their fixed size). A shard set
    is not read whole: its counts come from the index and the sizes from its first shard.

    Raises:
        DataError: see :func:`vitflow.data.open_split`; no readable image in the sample.
    """
    configure_remote(d)  # the run's retries, backoff and cache apply to the plan's reads too
    src = open_training(d)  # shards: streamed, the index's counts, the first shard's sizes
    return _profile(d.path, len(src), len(src.classes), src.sample_sizes(SAMPLE))


def _profile(path: str, images: int, classes: int, sizes: list[tuple[int, int]]) -> DataProfile:
    if not sizes:
        raise DataError(f"{path}: no readable image among the {min(SAMPLE, images)} sampled")
    short, long = np.median([min(s) for s in sizes]), np.median([max(s) for s in sizes])
    return DataProfile(images, classes, int(short), int(long))


def _pow2_at_most(x: float) -> int:
    return 2 ** max(0, int(math.floor(math.log2(max(x, 1)))))


def plan_overrides(profile: DataProfile, device: str, set_by_user: set[str],
                   family: str = "vit") -> list[tuple[str, object, str]]:
    """The planned ``(key, value, why)`` for the keys the user did not set (``set_by_user``).

    On a CPU the plan keeps about 64 tokens per image (an 8 x 8 grid: 64 px with patch 8, or
    32 px with patch 4 for small images) and the compact 9-block ViT; on a GPU 196 tokens
    (224 px, patch 16) and ViT-Small from 20,000 images. Batch: the largest power of two up to
    128 that gives at least 4 batches per epoch. Learning rate: the CIFAR recipe's 2e-3 at batch
    256 scaled with the square root of the batch (AdamW). Steps: 100 epochs below 20,000 images,
    else 30, between 300 and 20,000 steps, warmup 5%.

    A model the user named from another ``family`` than the plain ViT (a Swin, an MViT) keeps its own
    input size, patch size and position encoding: its windows are sized for them.
    """
    gpu = device.startswith("cuda")
    plan = _size_plan(profile, gpu) if family == "vit" else [
        ("model.pos_embed", "learned", f"a {family} model: its own position encoding, input size and patch size")]
    if gpu and profile.images >= 20_000:
        plan.append(("model.name", "vit_small_patch16_224", f"{profile.images} images: ViT-Small"))
    elif gpu:
        plan.append(("model.name", "vit_tiny_patch16_224", f"{profile.images} images: ViT-Tiny"))
    batch = min(128, _pow2_at_most(profile.images / 4))
    plan.append(("train.batch_size", batch, f"{profile.images} images: at least 4 batches per epoch, at most 128"))
    plan.append(("optim.lr", "by_batch", "2e-3 at batch 256, scaled with the square root of the batch (AdamW)"))
    epochs = 100 if profile.images < 20_000 else 30
    plan.append(("train.total_steps", f"epochs:{epochs}", f"{epochs} epochs of {profile.images} images"))
    return [p for p in plan if p[0] not in set_by_user]


def _size_plan(profile: DataProfile, gpu: bool) -> list[tuple[str, object, str]]:
    """The planned ``model.img_size`` and ``model.patch_size`` of a ViT (see :func:`plan_overrides`)."""
    native = profile.short_side
    if gpu:
        size, patch = 224, 16
        why = f"GPU: 224 px in 16-px patches (196 tokens); the images' median short side is {native} px"
    elif native < 48:
        size, patch = 32, 4
        why = f"small images (median short side {native} px): 32 px in 4-px patches, 64 tokens"
    else:
        size, patch = 64, 8
        why = (f"CPU: 64 px in 8-px patches keeps 64 tokens per image (attention cost grows with the square of the "
               f"tokens); the images' median short side is {native} px")
    return [("model.img_size", size, why), ("model.patch_size", patch, "see model.img_size")]


def resolve_plan(plan: list[tuple[str, object, str]], cfg_batch: int, images: int) -> list[tuple[str, object, str]]:
    """Fill the values that depend on the batch size (``by_batch``, ``epochs:N``) once it is known
    (the user's or the plan's), and add the warmup and evaluation intervals."""
    out = []
    for key, value, why in plan:
        if value == "by_batch":
            value = float(f"{2e-3 * math.sqrt(cfg_batch / 256):.2g}")
        elif isinstance(value, str) and value.startswith("epochs:"):
            steps = int(value[7:]) * max(1, images // cfg_batch)
            value = int(min(20_000, max(300, steps)))
            out += [("optim.warmup_steps", max(1, value // 20), "5% of the steps"),
                    ("train.eval_every", max(1, value // 5), "5 evaluations"),
                    ("train.checkpoint_every", max(1, value // 5), "a checkpoint at each evaluation")]
        out.append((key, value, why))
    return out


def size_warnings(m: ModelConfig, device: str, profile: DataProfile) -> list[str]:
    """Warnings when the input is far above what the images hold: over 256 tokens per image on a
    CPU for a model with global attention (a Swin attends within fixed windows, an MViT to keys
    pooled over the grid: their cost grows about linearly with the tokens), or an input size over twice the images' median short side
    (upsampled pixels carry no detail, and cost ``(size / patch)^2`` tokens). None for
    ``model.name=auto`` (the weights' architecture is known only once they are read). ``m``: the
    model section; ``device``: ``train.device``."""
    if m.name == "auto":
        return []
    out, defaults = [], model_kwargs(m.name)
    image, patch_size = m.img_size or defaults["img_size"], m.patch_size or defaults["patch_size"]
    tokens = (image // patch_size) ** 2
    windowed = family_of(m.name).name in ("swin", "mvit")
    if tokens > 256 and not windowed and not device.startswith("cuda"):
        better = max(patch_size, image // 8)
        out.append(f"{tokens} tokens per image ({image} px in {patch_size}-px patches) on a CPU: attention cost grows "
                   f"with the square of the tokens; model.patch_size={better} would give {(image // better) ** 2}")
    if image > 2 * profile.short_side:
        out.append(f"model.img_size={image} is over twice the images' median short side ({profile.short_side} px): "
                   "upsampled pixels add tokens, not detail")
    return out


def planned_config(overrides: list[str], checks, preset: str = PHOTO_PRESET) -> Config:
    """The config of ``vitflow train data.path=PHOTOS``: ``preset`` (the fixed part of the photo
    recipe), then the planned values (each logged with its reason), then ``overrides``, which
    always win. Logs the size warnings of :func:`size_warnings`.

    Raises:
        ConfigError, DataError: as :func:`vitflow.config.build_config` and :func:`profile_data`.
    """
    set_by_user = {o.split("=", 1)[0].strip() for o in overrides}
    base = build_config(preset, overrides=overrides, checks=checks, model_config=config_class)
    profile = profile_data(base.data)
    log.info("plan: %d training images of %d classes, median %dx%d px", profile.images, profile.classes,
             profile.long_side, profile.short_side)
    family = "vit" if base.model.name == "auto" else family_of(base.model.name).name
    keys = field_names(type(base.model))  # the planned model keys the family has (a Swin takes no pos_embed)
    plan = [p for p in plan_overrides(profile, resolve_device(base.train.device).type, set_by_user, family)
            if not p[0].startswith("model.") or p[0][6:] in keys]
    fixed = [f"{k}={v}" for k, v, _ in plan if not isinstance(v, str) or ":" not in v and v != "by_batch"]
    batch = build_config(preset, overrides=fixed + overrides, checks=checks, model_config=config_class).train.batch_size
    plan = [p for p in resolve_plan(plan, batch, profile.images) if p[0] not in set_by_user]
    for key, value, why in plan:
        log.info("plan: %s=%s  (%s)", key, value, why)
    cfg = build_config(preset, overrides=[f"{k}={v}" for k, v, _ in plan] + overrides, checks=checks,
                       model_config=config_class)
    for warning in size_warnings(cfg.model, cfg.train.device, profile):
        log.warning("%s", warning)
    log.info("resolved config (save it and pass --config FILE to repeat the run):\n%s", to_yaml(cfg).rstrip())
    return cfg


def is_planned(preset: str | None, config_file: str | None, overrides: list[str]) -> bool:
    """Whether ``vitflow train`` plans the run: ``--preset photos-auto``, or no preset and no
    config file with a ``data.path`` (and not built-in data such as the embedded digits)."""
    if preset == PHOTO_PRESET:
        return True
    keys = {o.split("=", 1)[0].strip(): o.split("=", 1)[1] for o in overrides if "=" in o}
    return not preset and not config_file and "data.path" in keys and reads_path(keys.get("data.source", "auto"))
