"""Per-image augmentation policies run on whole ``uint8`` batches on the device: RandAugment
(Cubuk et al. 2020), TrivialAugmentWide (Muller & Hutter 2021) and random erasing (Zhong et al.
2020), the same transforms as torchvision's ``v2.RandAugment(num_ops=2, magnitude=9)``,
``v2.TrivialAugmentWide()`` and ``v2.RandomErasing(p, value=0)`` that the per-image path applies,
so that the batched in-RAM path keeps its speed with them.

Each image draws its operations, magnitudes and boxes from its own generator, seeded from the
batch's key and its place in the batch, in exactly the order torchvision's transforms draw them
from the global generator: image ``k`` of a batch is bit-equal to torchvision's transform of that
image after ``torch.manual_seed(seeds[k])`` (tested in ``tests/data/test_policies.py``). The
images that drew the same operation and magnitude are then transformed together, with
torchvision's functional ops (``torchvision.transforms.v2.functional``), whose tensors may hold a
batch. The magnitude tables are torchvision's own (``_AUGMENTATION_SPACE``); the operations are
named as there.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

POLICIES = ("randaugment", "trivialaugment")  # data.auto_augment values this module runs batched
RA_SPACE = v2.RandAugment._AUGMENTATION_SPACE
TA_SPACE = v2.TrivialAugmentWide._AUGMENTATION_SPACE
BINS, RA_OPS, RA_MAGNITUDE = 31, 2, 9  # torchvision's magnitude bins; vitflow's RandAugment(2, 9)
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)  # torchvision's RandomErasing defaults
_NEAREST = InterpolationMode.NEAREST


def apply_op(images: torch.Tensor, op: str, magnitude: float) -> torch.Tensor:
    """torchvision's augmentation operation ``op`` (a key of its ``_AUGMENTATION_SPACE``) at
    ``magnitude`` on ``uint8 (..., 3, H, W)`` images, as ``v2.RandAugment`` applies it (nearest
    interpolation, zero fill; shears about the top-left corner)."""
    if op == "Identity":
        return images
    if op in ("ShearX", "ShearY"):
        degrees = math.degrees(math.atan(magnitude))
        shear = [degrees, 0.0] if op == "ShearX" else [0.0, degrees]
        return F.affine(images, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, interpolation=_NEAREST,
                        fill=None, center=[0, 0])
    if op in ("TranslateX", "TranslateY"):
        move = [int(magnitude), 0] if op == "TranslateX" else [0, int(magnitude)]
        return F.affine(images, angle=0.0, translate=move, scale=1.0, shear=[0.0, 0.0], interpolation=_NEAREST,
                        fill=None)
    if op == "Rotate":
        return F.rotate(images, angle=magnitude, interpolation=_NEAREST, fill=None)
    blends = {"Brightness": F.adjust_brightness, "Color": F.adjust_saturation, "Contrast": F.adjust_contrast,
              "Sharpness": F.adjust_sharpness}
    if op in blends:
        return blends[op](images, 1.0 + magnitude)
    if op == "Posterize":
        return F.posterize(images, bits=int(magnitude))
    if op == "Solarize":
        return F.solarize(images, threshold=255.0 * magnitude)
    if op == "AutoContrast":
        return F.autocontrast(images)
    if op == "Equalize":
        return F.equalize(images)
    raise ValueError(f"unknown augmentation operation {op!r}")


def _draw_ops(g: torch.Generator, space: dict, ops: int, magnitude: int | None, h: int, w: int
              ) -> list[tuple[str, float]]:
    """``ops`` operations and their signed magnitudes as torchvision draws them: RandAugment at the
    fixed bin ``magnitude``, TrivialAugmentWide (``magnitude=None``) at a random bin."""
    keys, out = tuple(space), []
    for _ in range(ops):
        op = keys[int(torch.randint(len(keys), (), generator=g))]
        table, signed = space[op]
        values = table(BINS, h, w)
        value = 0.0
        if values is not None:
            index = magnitude if magnitude is not None else int(torch.randint(BINS, (), generator=g))
            value = float(values[index])
            if signed and torch.rand((), generator=g) <= 0.5:
                value *= -1
        out.append((op, value))
    return out


def _draw_erase(g: torch.Generator, p: float, h: int, w: int) -> tuple[int, int, int, int] | None:
    """The box ``(i, j, eh, ew)`` ``v2.RandomErasing(p, value=0)`` erases, drawn as it draws it, or
    ``None`` (not applied, or no box fitting in 10 tries)."""
    if torch.rand(1, generator=g) >= p:
        return None
    log_ratio = torch.log(torch.tensor(ERASE_RATIO))
    for _ in range(10):
        area = h * w * torch.empty(1).uniform_(*ERASE_SCALE, generator=g).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g)).item()
        eh, ew = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if eh < h and ew < w:
            i = int(torch.randint(0, h - eh + 1, size=(1,), generator=g).item())
            j = int(torch.randint(0, w - ew + 1, size=(1,), generator=g).item())
            return i, j, eh, ew
    return None


class BatchPolicy:
    """``data.auto_augment`` (``randaugment`` / ``trivialaugment`` / ``none``) then
    ``data.random_erasing`` (a probability) on a ``uint8 (B, 3, H, W)`` batch (see the module text).
    ``enabled`` is False when both are off."""

    def __init__(self, policy: str = "none", erasing: float = 0.0):
        if policy not in ("none", *POLICIES):
            raise ValueError(f"data.auto_augment={policy!r} has no batched form (batched: {', '.join(POLICIES)})")
        self.policy, self.erasing = policy, erasing

    @property
    def enabled(self) -> bool:
        return self.policy != "none" or self.erasing > 0

    def __call__(self, images: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """``images`` transformed, image ``k`` as torchvision's transforms would after
        ``torch.manual_seed(seeds[k])``; a new tensor (the input is left as it is)."""
        h, w = images.shape[-2:]
        plans, boxes = [], []
        for seed in seeds:
            g = torch.Generator().manual_seed(int(seed))
            plans.append(_draw_ops(g, RA_SPACE, RA_OPS, RA_MAGNITUDE, h, w) if self.policy == "randaugment" else
                         _draw_ops(g, TA_SPACE, 1, None, h, w) if self.policy == "trivialaugment" else [])
            boxes.append(_draw_erase(g, self.erasing, h, w) if self.erasing > 0 else None)
        out = images.clone()
        for round_ in range(max((len(p) for p in plans), default=0)):
            groups: dict[tuple[str, float], list[int]] = defaultdict(list)
            for k, plan in enumerate(plans):
                groups[plan[round_]].append(k)
            for (op, value), members in groups.items():
                if op != "Identity":
                    idx = torch.tensor(members, device=images.device)
                    out[idx] = apply_op(out[idx], op, value)
        for k, box in enumerate(boxes):
            if box is not None:
                i, j, eh, ew = box
                out[k, :, i:i + eh, j:j + ew] = 0
        return out
