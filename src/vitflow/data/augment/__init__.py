"""Batched augmentation on the device, on ``uint8`` batches with an explicit generator per batch:
crops, flips, Mixup / CutMix and progressive resolution (:mod:`.crops`), and the per-image
policies (RandAugment, TrivialAugmentWide, random erasing) run batched (:mod:`.policies`)."""

from vitflow.data.augment.crops import (
    MixupCutmix,
    batch_generator,
    inception_boxes,
    pad_crop_flip,
    progressive_resolution,
    random_resized_crop_flip,
)
from vitflow.data.augment.policies import POLICIES, BatchPolicy

__all__ = ["POLICIES", "BatchPolicy", "MixupCutmix", "batch_generator", "inception_boxes", "pad_crop_flip",
           "progressive_resolution", "random_resized_crop_flip"]
