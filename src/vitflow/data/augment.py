"""Batched augmentation on the device: pad-and-random-crop with flips on ``uint8`` batches, and
Mixup / CutMix producing soft targets.

Randomness comes from an explicit :class:`torch.Generator` per batch, seeded from
``(seed, epoch, batch index)``, so results are reproducible, independent of worker count and
thread timing, and never touch the global RNG that dropout uses.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def batch_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def pad_crop_flip(images: torch.Tensor, padding: int, hflip: bool, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad by ``padding``, crop a random ``H x W`` window and flip half the images
    horizontally, per image, in a few batched ops (He et al. 2016's CIFAR augmentation).

    ``images``: ``uint8 (B, C, H, W)`` -> ``uint8 (B, C, H, W)`` on the same device. The crop
    gathers from ``unfold`` views of the padded batch (no per-image Python).
    """
    b, c, h, w = images.shape
    dev = images.device
    if padding:
        padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
        span = 2 * padding + 1
        dy = torch.randint(0, span, (b,), device=dev, generator=generator)
        dx = torch.randint(0, span, (b,), device=dev, generator=generator)
        windows = padded.unfold(2, h, 1).unfold(3, w, 1)  # (B, C, span, span, H, W) view
        images = windows[torch.arange(b, device=dev), :, dy, dx]
    if hflip:
        flip = torch.rand(b, device=dev, generator=generator) < 0.5
        images = torch.where(flip.view(b, 1, 1, 1), images.flip(-1), images)
    return images


class MixupCutmix:
    """Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) over a batch, as in timm's
    ``Mixup`` in ``batch`` mode: one mixing coefficient per batch, each image mixed with the image
    at the mirrored batch position.

    ``__call__(x, y, rng)``: ``x`` float ``(B, C, H, W)``, ``y`` int64 ``(B,)`` ->
    mixed ``x`` and soft targets float32 ``(B, num_classes)`` whose rows sum to 1 and whose weights
    equal the pixel proportions actually mixed (CutMix's ``lam`` is corrected to the box area).
    Label smoothing is not applied here: the loss applies it once.

    Args:
        mixup_alpha, cutmix_alpha: Beta(alpha, alpha) concentration; 0 disables that method.
        prob: probability that a batch is mixed at all.
        switch_prob: probability of CutMix rather than Mixup when both are enabled.
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, prob: float = 1.0,
                 switch_prob: float = 0.5):
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("MixupCutmix needs mixup_alpha > 0 or cutmix_alpha > 0")
        self.num_classes, self.mixup_alpha, self.cutmix_alpha = num_classes, mixup_alpha, cutmix_alpha
        self.prob, self.switch_prob = prob, switch_prob

    def __call__(self, x: torch.Tensor, y: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        one_hot = torch.nn.functional.one_hot(y, self.num_classes).float()
        if rng.random() >= self.prob:
            return x, one_hot
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < self.switch_prob)
        flipped = x.flip(0)
        if use_cutmix:
            lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
            h, w = x.shape[-2:]
            ch, cw = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = int(rng.integers(h)), int(rng.integers(w))
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
        else:
            lam = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
            x = x * lam + flipped * (1.0 - lam)
        return x, one_hot * lam + one_hot.flip(0) * (1.0 - lam)


def progressive_resolution(step: int, total_steps: int, start: int, end: int, ramp: tuple[float, float],
                           multiple: int) -> int:
    """Training resolution at ``step`` for progressive resizing (as in FFCV's ImageNet recipes
    and fast.ai): ``start`` px until ``ramp[0] * total_steps``, rising linearly to ``end`` px at
    ``ramp[1] * total_steps``, then ``end``; rounded down to a multiple of ``multiple`` (the patch
    size) and never below it."""
    a, b = ramp[0] * total_steps, ramp[1] * total_steps
    frac = 0.0 if step <= a else 1.0 if step >= b or b <= a else (step - a) / (b - a)
    size = start + frac * (end - start)
    return max(multiple, int(size // multiple) * multiple)
