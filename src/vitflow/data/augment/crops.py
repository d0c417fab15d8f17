"""Batched augmentation on the device: pad-and-random-crop or random-resized-crop with flips on
``uint8`` batches, and Mixup / CutMix producing soft targets.

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


def random_resized_crop_flip(images: torch.Tensor, size: int, scale: tuple[float, float] = (0.08, 1.0),
                             ratio: tuple[float, float] = (3 / 4, 4 / 3), hflip: bool = True,
                             generator: torch.Generator | None = None, interpolation: str = "bilinear") -> torch.Tensor:
    """The Inception crop (Szegedy et al. 2015, "Going deeper with convolutions"; the sampling of
    torchvision's ``RandomResizedCrop``) for a whole batch at once, then a random horizontal flip.

    Per image: a box of area fraction ``U(scale)`` of the image and aspect ratio (w / h)
    ``exp(U(log ratio))``, sides rounded to pixels; the first of 10 candidates that fits the image
    is taken, at a uniform integer position; when none fits, the whole image, or its central part
    clamped to the ``ratio`` range. The box is resampled to ``size x size`` with ``grid_sample``
    (``align_corners=False``: the pixel grid of ``interpolate`` on the box; edge taps may read the
    neighbouring pixels outside the box, not replicate the box's edge; no antialiasing, fine for
    the at most ~1.2x reduction of a crop of a cache at ``size / crop_pct``); ``hflip`` flips each
    output with probability 1/2 (folded into the sampling grid, exact). The grid is the one
    ``affine_grid`` gives for the box, built from its two separable 1-d axes, which is ~5x cheaper
    on the CPU. All draws come from ``generator`` (on ``images``' device) in one batched call each
    (no Python loop over images): same generator state, same output.

    Args:
        images: ``uint8 (B, C, H, W)`` on any device.
        interpolation: ``bilinear`` or ``bicubic`` (``grid_sample``'s kernels).
    Returns:
        ``uint8 (B, C, size, size)`` on ``images``' device, rounded and clamped to 0..255.
    Raises:
        ValueError: unknown ``interpolation``, or ``images`` not 4-d.
    """
    if interpolation not in ("bilinear", "bicubic"):
        raise ValueError(f"interpolation must be bilinear or bicubic, not {interpolation!r}")
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    b, c, h, w = images.shape
    if b == 0:
        return images.new_empty((0, c, size, size))
    top, left, ch, cw = inception_boxes(b, h, w, scale, ratio, generator, images.device)
    # the affine grid of each box, built separably: output pixel centres -> input coordinates in [-1, 1]
    k = (torch.arange(size, device=images.device, dtype=torch.float32) + 0.5) / size
    gx = (left[:, None] + k * cw[:, None]) * (2 / w) - 1  # (B, size): x of each output column
    gy = (top[:, None] + k * ch[:, None]) * (2 / h) - 1  # (B, size): y of each output row
    if hflip:  # a flipped output samples its columns in reverse: the same pixels, mirrored
        flip = torch.rand(b, device=images.device, generator=generator) < 0.5
        gx = torch.where(flip[:, None], gx.flip(-1), gx)
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), -1)  # (B, size, size, 2)
    out = torch.nn.functional.grid_sample(images.float(), grid, mode=interpolation, padding_mode="border",
                                          align_corners=False)
    return out.clamp_(0, 255).add_(0.5).to(torch.uint8)  # rounded (half up)


def inception_boxes(b: int, h: int, w: int, scale: tuple[float, float], ratio: tuple[float, float],
                    generator: torch.Generator | None, device: torch.device | str = "cpu",
                    tries: int = 10) -> tuple[torch.Tensor, ...]:
    """``b`` random crop boxes of an ``h x w`` image, drawn as torchvision's ``RandomResizedCrop``
    draws one (see :func:`random_resized_crop_flip`), all at once: ``tries`` candidates per box
    (``2`` draws of ``(b, tries)``), then a position (a ``(b, 2)`` draw).

    Returns:
        ``(top, left, height, width)``, each float32 ``(b,)`` of whole pixels on ``device``, with
        ``0 < height <= h``, ``0 < width <= w``, the box inside the image.
    """
    area = torch.rand(b, tries, device=device, generator=generator) * (scale[1] - scale[0]) + scale[0]
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(torch.rand(b, tries, device=device, generator=generator) * (hi - lo) + lo)
    pos = torch.rand(b, 2, device=device, generator=generator)
    target = area * (h * w)
    cw, ch = torch.sqrt(target * aspect).round(), torch.sqrt(target / aspect).round()
    ok = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = ok.to(torch.int8).argmax(1, keepdim=True)  # the first fitting candidate (0 when none fits)
    cw, ch, found = cw.gather(1, first)[:, 0], ch.gather(1, first)[:, 0], ok.any(1)
    fw, fh = float(w), float(h)  # the fallback: the whole image, clamped to the ratio range
    if w / h < min(ratio):
        fh = float(round(w / min(ratio)))
    elif w / h > max(ratio):
        fw = float(round(h * max(ratio)))
    cw, ch = torch.where(found, cw, fw), torch.where(found, ch, fh)
    top = torch.minimum((pos[:, 0] * (h - ch + 1)).floor(), h - ch)
    left = torch.minimum((pos[:, 1] * (w - cw + 1)).floor(), w - cw)
    top = torch.where(found, top, (h - ch).div(2, rounding_mode="floor"))
    left = torch.where(found, left, (w - cw).div(2, rounding_mode="floor"))
    return top, left, ch, cw


class MixupCutmix:
    """Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) over a batch, as in timm's
    ``Mixup`` in ``batch`` mode: one mixing coefficient per batch, each image mixed with the image
    at the mirrored batch position.

    ``__call__(x, y, rng)``: ``x`` float ``(B, C, H, W)``, ``y`` int64 ``(B,)`` (or multi-hot
    ``(B, num_classes)`` for multi-label) -> mixed ``x`` and soft targets float32
    ``(B, num_classes)``: the two images' targets weighted by the pixel proportions actually mixed
    (CutMix's ``lam`` is corrected to the box area); rows sum to 1 for single-label targets.
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
        one_hot = y.float() if y.dim() == 2 else torch.nn.functional.one_hot(y, self.num_classes).float()
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
