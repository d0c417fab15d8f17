"""The ViT family: named variants of :class:`~vitflow.models.vit.model.VisionTransformer` and DeiT's
distilled ViT, with timm's names.

Widths, depths and heads of the 224-px variants follow the ViT paper (Dosovitskiy et al. 2021,
table 1: Base, Large, Huge) and DeiT (Touvron et al. 2021: Tiny, Small); every variant uses a
head dimension of 64 except where stated.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn as nn

from vitflow.config import ViTConfig
from vitflow.models.family import ModelFamily
from vitflow.models.pretrained.weights import load_pretrained
from vitflow.models.vit.checks import check_vit_config
from vitflow.models.vit.distilled import VisionTransformerDistilled
from vitflow.models.vit.model import VisionTransformer

_SIZES = {  # name: (embed_dim, depth, num_heads)
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}


def _variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for size, (dim, depth, heads) in _SIZES.items():
        for patch in (16, 32):
            out[f"vit_{size}_patch{patch}_224"] = dict(img_size=224, patch_size=patch, embed_dim=dim, depth=depth,
                                                        num_heads=heads)
    # Small-image variants for 32x32 inputs (CIFAR): patch 4 gives an 8x8 grid, 65 tokens.
    out["vit_tiny_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3)
    out["vit_small_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6)
    # The compact CIFAR ViT of the project's CPU baselines: ViT-Tiny width, 9 blocks, MLP ratio 2.
    out["vit_cifar_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=192, depth=9, num_heads=3, mlp_ratio=2.0)
    # For 8x8 images (scikit-learn's handwritten digits, the embedded default): 4x4 grid of 2x2 patches.
    out["vit_digits_patch2_8"] = dict(img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0,
                                      global_pool="avg")
    # DeiT with the distillation token (Touvron et al. 2021), timm's names and sizes.
    for size in ("tiny", "small", "base"):
        dim, depth, heads = _SIZES[size]
        out[f"deit_{size}_distilled_patch16_224"] = dict(img_size=224, patch_size=16, embed_dim=dim, depth=depth,
                                                        num_heads=heads, distilled=True)
    return out


def build(distilled: bool = False, grad_checkpointing: str | bool = "none",
          grad_checkpointing_budget: str | int | None = None, **kwargs: Any) -> nn.Module:
    """A :class:`VisionTransformer` (or, with ``distilled``, a
    :class:`~vitflow.models.vit.distilled.VisionTransformerDistilled`) from its constructor
    arguments (the keys of its ``model`` section and the variant's), with gradient checkpointing
    set (:meth:`VisionTransformer.set_grad_checkpointing`).

    Raises:
        ValueError: invalid arguments (see the constructors).
    """
    model = (VisionTransformerDistilled if distilled else VisionTransformer)(**kwargs)
    model.set_grad_checkpointing(grad_checkpointing, grad_checkpointing_budget)
    return model


def summary(args: dict[str, Any]) -> str:
    return (f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  "
            f"depth {args['depth']:>2}  heads {args['num_heads']:>2}  mlp {args.get('mlp_ratio', 4.0):g}"
            + ("  distilled" if args.get("distilled") else ""))


# what the ViT builds take beyond the config's keys: VisionTransformer's other arguments (class_token, ...)
ARGUMENTS = frozenset(inspect.signature(VisionTransformer).parameters)
VIT = ModelFamily("vit", "Vision Transformer (Dosovitskiy et al. 2021) and DeiT (Touvron et al. 2021)",
                  _variants(), build, load_pretrained, summary, config=ViTConfig, arguments=ARGUMENTS,
                  check_config=check_vit_config)
