"""RandAugment, TrivialAugment and random erasing run batched on the device (vitflow.data.augment.policies):
image k of a batch is bit-equal to torchvision's transform of that image after
``torch.manual_seed(seeds[k])``, on real photos, for fixed seeds."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms import v2

from helpers import CIFAR_TAR, need
from vitflow.data import open_split
from vitflow.data.augment.policies import BatchPolicy
from vitflow.data.transforms import train_transform

SEEDS = list(range(7000, 7048))


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """48 real CIFAR-10 photos, ``uint8 (48, 3, 32, 32)``."""
    src = open_split(need(CIFAR_TAR), "test[:48]")
    return torch.stack([src.load(i) for i in range(len(src))])


def torchvision_per_image(images: torch.Tensor, make) -> torch.Tensor:
    out = []
    for image, seed in zip(images, SEEDS):
        torch.manual_seed(seed)
        out.append(make()(image))
    return torch.stack(out)


@pytest.mark.parametrize("policy,erasing,make", [
    ("randaugment", 0.0, lambda: v2.RandAugment(num_ops=2, magnitude=9)),
    ("trivialaugment", 0.0, v2.TrivialAugmentWide),
    ("none", 0.5, lambda: v2.RandomErasing(p=0.5, value=0)),
    ("trivialaugment", 0.25, lambda: v2.Compose([v2.TrivialAugmentWide(), v2.RandomErasing(p=0.25, value=0)])),
])
def test_batched_policy_equals_torchvision_per_image(images, policy, erasing, make):
    batched = BatchPolicy(policy, erasing)(images, SEEDS)
    want = torchvision_per_image(images, make)
    assert torch.equal(batched, want)
    changed = (batched != images).flatten(1).any(1).float().mean()
    assert 0.3 < changed <= 1.0  # it did augment (Identity and p < 1 leave some images as they were)


def test_the_per_image_path_runs_the_same_policies(images):
    """vitflow's per-image transform chain uses the same torchvision ops (RandAugment(2, 9), erasing to 0)."""
    ops = [type(t).__name__ for t in train_transform(32, "none", auto_augment="randaugment", random_erasing=0.25,
                                                     hflip=False).transforms]
    assert ops[-2:] == ["RandAugment", "RandomErasing"]


def test_policy_leaves_its_input_and_refuses_what_it_cannot_batch(images):
    before = images.clone()
    BatchPolicy("randaugment")(images, SEEDS)
    assert torch.equal(images, before)
    assert not BatchPolicy().enabled
    with pytest.raises(ValueError, match="data.auto_augment='autoaugment' has no batched form"):
        BatchPolicy("autoaugment")
