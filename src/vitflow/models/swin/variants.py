"""The Swin family: named variants of :class:`~vitflow.models.swin.model.SwinTransformer` with timm's
names and configurations, and the model-config handling.

- Swin (Liu et al. 2021, table 1): T / S / B / L, patch 4, window 7 at 224 px, window 12 at 384;
- Swin V2 (Liu et al. 2022): timm's ``swinv2_*`` (window 8 / 16 at 256 px, window 12 at 192,
  the ``12to16`` / ``12to24`` fine-tunes with V2's pretrained window sizes);
- ``swin_cifar_patch2_window4_32``: 32x32 inputs (CIFAR), patch 2 (a 16x16 grid), window 4,
  width 96, depths (2, 2, 2) over three stages (16x16, 8x8, 4x4 grids).

``model.depth`` / ``model.num_heads`` are per stage in a Swin: a single number is refused (give
``depths`` / ``num_heads`` tuples to :func:`vitflow.create_model` instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from vitflow.config import ModelConfig
from vitflow.models.family import ModelFamily
from vitflow.models.pretrained.weights import load_pretrained
from vitflow.models.swin.model import SwinTransformer

_SIZES = {  # name: (embed_dim, depths, num_heads)
    "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "large": (192, (2, 2, 18, 2), (6, 12, 24, 48)),
}
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
# ModelConfig keys that are SwinTransformer arguments as they are
_DIRECT = ("img_size", "num_classes", "embed_dim", "mlp_ratio", "patch_size", "global_pool", "attention",
           "drop_rate", "drop_path_rate", "cpu_bf16_matmul")
_BACKEND_OPTIONS = ("attn_block_size", "attn_window", "linformer_k", "performer_features")  # unused by windows
_REASONS = {
    "depth": "a Swin's depth is per stage: give depths=(2, 2, 6, 2) to vitflow.create_model",
    "num_heads": "a Swin's heads are per stage: give num_heads=(3, 6, 12, 24) to vitflow.create_model",
    "layer_scale_init": "Swin has no LayerScale",
    "patch_drop_rate": "PatchDropout would break the window grid",
    "weight_init": "only timm's initialisation ('timm') is implemented",
    "distilled": "no distillation token",
}
_ARGS = {"in_chans", "depths", "num_heads", "window_size", "qkv_bias", "version", "pretrained_window_sizes",
         "attn_drop_rate", *_DIRECT}


def _v1(size: str, img: int, window: int) -> dict[str, Any]:
    dim, depths, heads = _SIZES[size]
    return dict(img_size=img, patch_size=4, window_size=window, embed_dim=dim, depths=depths, num_heads=heads)


def _variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for size in ("tiny", "small", "base", "large"):
        out[f"swin_{size}_patch4_window7_224"] = _v1(size, 224, 7)
    for size in ("base", "large"):
        out[f"swin_{size}_patch4_window12_384"] = _v1(size, 384, 12)
    v2 = dict(patch_size=4, version=2)
    for size in ("tiny", "small", "base"):
        for window in (8, 16):
            out[f"swinv2_{size}_window{window}_256"] = dict(_v1(size, 256, window), **v2)
    for size in ("base", "large"):
        out[f"swinv2_{size}_window12_192"] = dict(_v1(size, 192, 12), **v2)
        for window, img in ((16, 256), (24, 384)):
            out[f"swinv2_{size}_window12to{window}_192to{img}"] = dict(
                _v1(size, img, window), pretrained_window_sizes=(12, 12, 12, 6), **v2)
    # 32x32 inputs (CIFAR): patch 2 -> 16x16, 8x8, 4x4 grids; window 4 shifts in every stage
    out["swin_cifar_patch2_window4_32"] = dict(img_size=32, patch_size=2, window_size=4, embed_dim=96,
                                               depths=(2, 2, 2), num_heads=(3, 6, 12), mlp_ratio=2.0)
    return out


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """Pop the model-config keys a Swin cannot honour (a non-default value raises, naming the key)."""
    pos = kwargs.pop("pos_embed", "learned")
    if pos not in ("learned", "relative"):
        raise ValueError(f"model.pos_embed={pos!r} is not available for Swin models: their position encoding is the "
                         "per-window relative bias (leave model.pos_embed at its default)")
    for key, why in _REASONS.items():
        value = kwargs.get(key, _CONFIG_DEFAULTS[key])
        if key in ("depth", "num_heads") and not isinstance(value, (int, type(None))):
            continue  # a per-stage tuple: a constructor argument
        kwargs.pop(key, None)
        if value != _CONFIG_DEFAULTS[key]:
            raise ValueError(f"model.{key}={value!r} is not available for Swin models: {why}")
    for key in _BACKEND_OPTIONS:
        kwargs.pop(key, None)
    for key in ("block_heads", "block_mlp_hidden"):
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"{key}: Swin models cannot be head- or MLP-pruned (vitflow prune handles the ViT "
                             "family only)")
    unknown = sorted(k for k in kwargs if k not in _ARGS)
    if unknown:
        raise ValueError(f"unknown argument(s) for Swin models: {', '.join(unknown)}")


def build(grad_checkpointing: str | bool = "none", grad_checkpointing_budget: str | int | None = None,
          **kwargs: Any) -> nn.Module:
    """A :class:`SwinTransformer` from a variant's arguments plus any keys of
    :class:`~vitflow.config.ModelConfig` (``grad_checkpointing`` and its budget applied after
    construction).

    Raises:
        ValueError: a model-config value Swin cannot honour (named), or bad arguments.
    """
    _refuse_unsupported(kwargs)
    model = SwinTransformer(**kwargs)
    model.set_grad_checkpointing(grad_checkpointing, grad_checkpointing_budget)
    return model


def summary(args: dict[str, Any]) -> str:
    """A short ``vitflow models`` column for a variant."""
    depths = "-".join(str(d) for d in args["depths"])
    return (f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  "
            f"depths {depths}  window {args['window_size']}" + ("  V2" if args.get("version") == 2 else ""))


SWIN = ModelFamily("swin", "Swin Transformer (Liu et al. 2021) and Swin V2 (Liu et al. 2022): shifted windows",
                   _variants(), build, load_pretrained, summary)
