"""Per-image transforms (torchvision.transforms.v2 on ``uint8`` tensors) and batched
normalisation on the device.

Images stay ``uint8`` ``(3, H, W)`` from decode to the device; :func:`model_input` turns a
``uint8`` batch into the model's float input in one batched op there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torchvision.transforms import InterpolationMode, v2

from vitflow.data.decode import decode_image, reducible_size

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Preprocess:
    """Everything needed to turn an image into model input at evaluation / prediction time.

    Saved with every checkpoint so that predict sees exactly what evaluation saw.
    """

    image_size: int
    crop_pct: float = 0.875
    interpolation: str = "bicubic"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def to_dict(self) -> dict:
        return {"image_size": self.image_size, "crop_pct": self.crop_pct, "interpolation": self.interpolation,
                "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, d: dict) -> "Preprocess":
        return cls(int(d["image_size"]), float(d["crop_pct"]), str(d["interpolation"]), tuple(d["mean"]),
                   tuple(d["std"]))


def _interp(name: str) -> InterpolationMode:
    return InterpolationMode.BICUBIC if name == "bicubic" else InterpolationMode.BILINEAR


def eval_transform(pp: Preprocess) -> Transform:
    """Resize the shorter side to ``image_size / crop_pct``, then center-crop ``image_size``
    (the standard ImageNet evaluation transform; ``crop_pct=1`` gives a plain resize).
    ``uint8 (3, H, W)`` -> ``uint8 (3, S, S)``."""
    resize = int(round(pp.image_size / pp.crop_pct))
    return v2.Compose([
        _ResizeIfNeeded(resize, _interp(pp.interpolation)),
        v2.CenterCrop(pp.image_size),
    ])


def eval_view(pp: Preprocess, width: int, height: int) -> tuple[float, float, float, float]:
    """The part of a ``width x height`` image that :func:`eval_transform` keeps, in the image's
    pixels: ``(x0, y0, x1, y1)`` (floats; the centered square of side ``min(width, height) *
    crop_pct``, capped at the image). A map over the model's input lies over this box."""
    side = min(width, height) * min(1.0, pp.image_size / round(pp.image_size / pp.crop_pct))
    x0, y0 = (width - side) / 2, (height - side) / 2
    return x0, y0, x0 + side, y0 + side


def resolve_augment(augment: str, image_size: int) -> str:
    """``auto`` -> ``pad_crop`` up to 64 px, else ``random_resized_crop``; others unchanged."""
    if augment == "auto":
        return "pad_crop" if image_size <= 64 else "random_resized_crop"
    return augment


def train_transform(image_size: int, augment: str, scale: Sequence[float] = (0.08, 1.0), padding: int = 4,
                    hflip: bool = True, interpolation: str = "bicubic", auto_augment: str = "none",
                    color_jitter: float = 0.0, random_erasing: float = 0.0) -> Transform:
    """Per-image training augmentation. ``uint8 (3, H, W)`` -> ``uint8 (3, S, S)``.

    Args:
        augment: ``random_resized_crop`` (Szegedy et al. 2015, Inception crop; area in ``scale``,
            aspect 3/4..4/3), ``pad_crop`` (resize to ``image_size`` if needed, zero-pad by
            ``padding``, random ``image_size`` crop: the CIFAR recipe of He et al. 2016),
            ``none`` (resize only), or ``auto`` (see :func:`resolve_augment`).
        hflip: random horizontal flip with p=0.5.
        auto_augment: ``randaugment`` (Cubuk et al. 2020; 2 ops, magnitude 9),
            ``trivialaugment`` (TrivialAugmentWide, Muller & Hutter 2021), ``autoaugment``
            (Cubuk et al. 2019, ImageNet policy) or ``none``.
        color_jitter: brightness/contrast/saturation jitter strength (0 = off).
        random_erasing: probability of erasing a random rectangle (Zhong et al. 2020; 0 = off).
    All ops are torchvision.transforms.v2 working on ``uint8`` tensors.
    """
    augment = resolve_augment(augment, image_size)
    ops: list[Transform]
    if augment == "random_resized_crop":
        ops = [RandomResizedCrop(image_size, scale=tuple(scale), interpolation=_interp(interpolation))]
    elif augment == "pad_crop":
        ops = [_ResizeIfNeeded(image_size, _interp(interpolation), exact=True)]
        if padding:
            ops.append(v2.RandomCrop(image_size, padding=padding))
    elif augment == "none":
        ops = [_ResizeIfNeeded(image_size, _interp(interpolation), exact=True)]
    else:
        raise ValueError(f"unknown augmentation {augment!r}")
    if hflip:
        ops.append(RandomHorizontalFlip())
    policy = {"randaugment": lambda: v2.RandAugment(num_ops=2, magnitude=9),
              "trivialaugment": v2.TrivialAugmentWide, "autoaugment": v2.AutoAugment}
    if auto_augment != "none":
        ops.append(policy[auto_augment]())
    if color_jitter > 0:
        ops.append(v2.ColorJitter(color_jitter, color_jitter, color_jitter))
    if random_erasing > 0:
        ops.append(v2.RandomErasing(p=random_erasing, value=0))
    return TrainTransform(ops)


def transform_encoded(transform: Transform, data: bytes, path: str = "<bytes>") -> torch.Tensor:
    """``transform(decode_image(data, path))``; a :class:`TrainTransform` decodes only what its
    crop needs. Raises CorruptImageError."""
    if isinstance(transform, TrainTransform):
        return transform.from_encoded(data, path)
    return transform(decode_image(data, path))


class TrainTransform(v2.Compose):
    """The training ops in order; :meth:`from_encoded` lets a leading :class:`RandomResizedCrop`
    see the encoded image, so that a JPEG much larger than the crop's output is decoded at a
    reduced DCT scale."""

    def from_encoded(self, data: bytes, path: str = "<bytes>") -> torch.Tensor:
        """``self(decode_image(data, path))``, decoding no more pixels than the first op needs.
        Raises CorruptImageError."""
        first, rest = self.transforms[0], self.transforms[1:]
        img = first.from_encoded(data, path) if isinstance(first, RandomResizedCrop) else first(decode_image(data, path))
        for op in rest:
            img = op(img)
        return img


class RandomResizedCrop(v2.RandomResizedCrop):
    """torchvision's RandomResizedCrop (same parameters, draws and output) that, for bilinear
    interpolation, skips the antialiasing kernel when the crop is enlarged: there it gives the
    same pixels (tested) at half the cost, which matters for packed, reduced-size images whose
    crops are mostly smaller than the output. Bicubic keeps the antialiased (PIL-like) kernel."""

    def __init__(self, size: int, scale=(0.08, 1.0), interpolation=InterpolationMode.BILINEAR):
        super().__init__(size, scale=scale, interpolation=interpolation, antialias=True)

    def from_encoded(self, data: bytes, path: str = "<bytes>") -> torch.Tensor:
        """``self(decode_image(data, path))`` with the same random draws, an upright JPEG decoded
        at the smallest DCT scale (1/8, 1/4, 1/2, full) at which the crop keeps at least the
        output's pixels on each side, the crop box mapped to that scale (the pixels then differ
        from a full-size decode by resampling only). Raises CorruptImageError."""
        size = reducible_size(data)
        if size is None:
            return self(decode_image(data, path))
        w, h = size
        make_params = getattr(self, "make_params", None) or self._get_params  # torchvision >= 0.21 / older
        params = make_params([torch.empty(()).expand(3, h, w)])  # a size-only stand-in, no pixels
        need = (-(-w * self.size[1] // params["width"]), -(-h * self.size[0] // params["height"]))
        img = decode_image(data, path, min_size=need)
        dh, dw = img.shape[-2:]
        if (dh, dw) != (h, w):
            top, left = params["top"] * dh // h, params["left"] * dw // w
            params = dict(top=top, left=left, height=max(1, min(dh - top, round(params["height"] * dh / h))),
                          width=max(1, min(dw - left, round(params["width"] * dw / w))))
        return self.transform(img, params)

    def forward(self, img):
        if type(img) is not torch.Tensor:  # tv_tensors, PIL images, several inputs: torchvision's dispatch
            return super().forward(img)
        return self.transform(img, self.make_params([img]))

    def transform(self, inpt, params):
        aa = (self.interpolation != InterpolationMode.BILINEAR or params["height"] > self.size[0]
              or params["width"] > self.size[1])
        if self.interpolation == InterpolationMode.BILINEAR and type(inpt) is torch.Tensor and inpt.ndim == 3 \
                and inpt.dtype in (torch.uint8, torch.float32) and inpt.device.type == "cpu":
            return _resized_crop_bilinear(inpt, params, self.size, aa)
        return v2.functional.resized_crop(inpt, **params, size=self.size, interpolation=self.interpolation,
                                          antialias=aa)


def _resized_crop_bilinear(img: torch.Tensor, params: dict, size, antialias: bool) -> torch.Tensor:
    """``v2.functional.resized_crop`` (bilinear, ``(C, H, W)`` uint8 or float32 on the CPU) without
    its dispatch: the crop is a view and torch's native uint8 kernel resamples it. A channels-last
    view (as the JPEG decoder returns) is restrided so that the output stays channels-last, the
    same trick torchvision plays, which saves a re-packing copy. Same pixels (tested)."""
    crop = img[:, params["top"]:params["top"] + params["height"], params["left"]:params["left"] + params["width"]]
    if (crop.shape[1], crop.shape[2]) == tuple(size):
        return crop
    x = crop.unsqueeze(0)
    if x.is_contiguous(memory_format=torch.channels_last) and x.numel() != x.stride(0):
        x = x.as_strided(x.shape, (x.numel(), *x.stride()[1:]))
    return torch.nn.functional.interpolate(x, size=list(size), mode="bilinear", align_corners=False,
                                           antialias=antialias)[0]


class RandomHorizontalFlip(v2.RandomHorizontalFlip):
    """torchvision's RandomHorizontalFlip (the same ``torch.rand(1)`` draw per call) without the
    dispatch overhead for a plain tensor ``(..., H, W)``."""

    def forward(self, *inputs):
        if len(inputs) != 1 or type(inputs[0]) is not torch.Tensor:
            return super().forward(*inputs)
        img = inputs[0]
        return img if torch.rand(1) >= self.p else img.flip(-1)


class _ResizeIfNeeded(torch.nn.Module):
    """Resize the shorter side to ``size`` (or to exactly ``size x size`` if ``exact``); a no-op
    when the image already has that size."""

    def __init__(self, size: int, interpolation: InterpolationMode, exact: bool = False):
        super().__init__()
        self.size, self.interpolation, self.exact = size, interpolation, exact

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        if (self.exact and h == w == self.size) or (not self.exact and min(h, w) == self.size):
            return img
        target = [self.size, self.size] if self.exact else self.size
        return v2.functional.resize(img, target, interpolation=self.interpolation, antialias=True)


def model_input(images: torch.Tensor, mean: Sequence[float], std: Sequence[float], device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """The one conversion of a batch of images into a model's input, used by training,
    evaluation, prediction, pruning and export checks.

    Args:
        images: ``uint8 (B, 3, H, W)`` in 0..255 (or one image ``(3, H, W)``), on any device.
        mean: per-channel means on the 0..1 scale (the checkpoint's preprocessing).
        std: per-channel standard deviations on the 0..1 scale.
        device: where the model runs (the copy is non-blocking); ``None`` keeps the images' device.
        dtype: the model's input dtype, e.g. ``torch.bfloat16`` for bf16 weights; ``None`` = float32.
    Returns:
        ``(x / 255 - mean) / std`` as ``dtype`` on ``device``, computed in float32 with one
        allocation.
    """
    if device is not None:
        images = images.to(device, non_blocking=True)
    m = torch.tensor(mean, device=images.device, dtype=torch.float32).view(-1, 1, 1) * 255.0
    s = torch.tensor(std, device=images.device, dtype=torch.float32).view(-1, 1, 1) * 255.0
    x = images.to(torch.float32).sub_(m).div_(s)  # one allocation, then in place
    return x if dtype in (None, torch.float32) else x.to(dtype)
