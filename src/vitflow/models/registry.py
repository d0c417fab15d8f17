"""Named ViT variants and ``create_model`` / ``list_models``.

Widths, depths and heads of the 224-px variants follow the ViT paper (Dosovitskiy et al. 2021,
table 1: Base, Large, Huge) and DeiT (Touvron et al. 2021: Tiny, Small); every variant uses a
head dimension of 64 except where stated.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from vitflow.models.distilled import VisionTransformerDistilled
from vitflow.models.vit import VisionTransformer

_SIZES = {  # name: (embed_dim, depth, num_heads)
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
    "huge": (1280, 32, 16),
}

MODELS: dict[str, dict[str, Any]] = {}
for _size, (_dim, _depth, _heads) in _SIZES.items():
    for _patch in (16, 32):
        MODELS[f"vit_{_size}_patch{_patch}_224"] = dict(
            img_size=224, patch_size=_patch, embed_dim=_dim, depth=_depth, num_heads=_heads)
# Small-image variants for 32x32 inputs (CIFAR): patch 4 gives an 8x8 grid, 65 tokens.
MODELS["vit_tiny_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3)
MODELS["vit_small_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6)
# The compact CIFAR ViT used in the project's CPU baselines: ViT-Tiny width, 9 blocks, MLP ratio 2.
MODELS["vit_cifar_patch4_32"] = dict(img_size=32, patch_size=4, embed_dim=192, depth=9, num_heads=3, mlp_ratio=2.0)
# For 8x8 images (scikit-learn's handwritten digits, the embedded default): 4x4 grid of 2x2 patches.
MODELS["vit_digits_patch2_8"] = dict(img_size=8, patch_size=2, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0,
                                     global_pool="avg")
# DeiT with the distillation token (Touvron et al. 2021), timm's names and sizes.
for _size in ("tiny", "small", "base"):
    _dim, _depth, _heads = _SIZES[_size]
    MODELS[f"deit_{_size}_distilled_patch16_224"] = dict(img_size=224, patch_size=16, embed_dim=_dim, depth=_depth,
                                                        num_heads=_heads, distilled=True)


def list_models(pattern: str | None = None) -> list[str]:
    """Sorted registered variant names, optionally filtered by a shell-style ``pattern``
    (e.g. ``"vit_small_*"``)."""
    names = sorted(MODELS)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def model_kwargs(name: str, **overrides: Any) -> dict[str, Any]:
    """Constructor arguments of variant ``name`` with ``overrides`` applied.

    Raises:
        ValueError: unknown variant (the message names the closest registered ones).
    """
    if name not in MODELS:
        import difflib

        close = difflib.get_close_matches(name, MODELS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see vitflow.list_models()"
        raise ValueError(f"unknown model {name!r}{hint}")
    return {**MODELS[name], **{k: v for k, v in overrides.items() if v is not None}}


def create_model(name: str, pretrained: str | Path | None = None, **overrides: Any) -> VisionTransformer:
    """Build a registered ViT variant, optionally loading weights.

    Args:
        name: a name from :func:`list_models`.
        pretrained: path to a weights file (``.safetensors``, or a ``.pt``/``.pth``/``.bin``
            state_dict or vitflow checkpoint) in timm's ViT layout. A head of another class count
            is reset; a position embedding of another grid is resampled bicubically.
        **overrides: constructor arguments of :class:`VisionTransformer` (``num_classes``,
            ``img_size``, ``drop_path_rate``, ``attention``, ...); ``None`` values are ignored.
            ``distilled=True`` builds DeiT's :class:`~vitflow.models.distilled.VisionTransformerDistilled`.
    Raises:
        ValueError: unknown name or incompatible weights; FileNotFoundError: missing weights file.
    """
    kwargs = model_kwargs(name, **overrides)
    model = (VisionTransformerDistilled if kwargs.pop("distilled", False) else VisionTransformer)(**kwargs)
    if pretrained is not None:
        from vitflow.models.weights import load_pretrained

        load_pretrained(model, pretrained)
    return model
