"""The MViTv2 family: named variants of :class:`~vitflow.models.mvit.model.MultiScaleVit` with timm's
names and configurations, and the model-config handling.

- timm's ``mvitv2_tiny`` / ``_small`` / ``_base`` / ``_large`` (ImageNet-1k, average pooling) and
  ``mvitv2_small_cls`` / ``_base_cls`` / ``_large_cls`` / ``_huge_cls`` (class token) at 224 px
  (Li et al. 2022, table 2; timm's ``model_cfgs``);
- ``mvit_v2_s``: torchvision's image-input form of its video MViTv2-S (``mvitv2_small_cls`` with
  key / value stride 8 in stage 0 and no residual pooling on the class token), the model that
  torchvision's weights load into (:mod:`vitflow.models.convert.torchvision_mvit`);
- ``mvitv2_cifar_32``: 32x32 inputs (CIFAR). Patch embedding kernel 3, stride 2 (a 16x16 grid, the
  grid a 224-px image gets per 14 px), three stages on 16x16, 8x8 and 4x4 grids (MViTv2-T's
  first three; a fourth would be 2x2), widths 64 / 128 / 256 with 1 / 2 / 4 heads of 64,
  depths 1 / 2 / 5 (MViTv2-T's: most blocks at the coarsest grid), MLP ratio 2 (as the CIFAR
  ViT and Swin), key / value stride 2 in stage 0 (8x8 keys for 16x16 queries; stride 1 after).

Model-config keys (:class:`~vitflow.config.ModelConfig`, until an ``MViTConfig`` replaces this
module's adapter): ``img_size``, ``num_classes``, ``embed_dim`` and ``num_heads`` (the first
stage's, doubled per stage: timm's rule), ``mlp_ratio``, ``patch_size`` (the patch embedding's
stride), ``global_pool`` (``avg``; ``token`` with a class token), ``attention`` (``sdpa``,
``math``, ``auto``), ``drop_rate``, ``drop_path_rate``, ``cpu_bf16_matmul``,
``grad_checkpointing`` (+ budget). ``model.depth`` is per stage (give ``depths``); the others are
refused by name when set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from vitflow.config import ModelConfig
from vitflow.models.family import ModelFamily
from vitflow.models.mvit.model import MultiScaleVit
from vitflow.models.pretrained.weights import load_pretrained

_BASE = dict(img_size=224, patch_size=4, embed_dim=96, num_heads=1)
_SIZES = {  # name: (depths, extra arguments)
    "tiny": ((1, 2, 5, 2), {}),
    "small": ((1, 2, 11, 2), {}),
    "base": ((2, 3, 16, 3), {}),
    "large": ((2, 6, 36, 4), dict(embed_dim=144, num_heads=2, expand_attn=False)),
}
_CLS = {  # timm's *_cls configurations
    "small": ((1, 2, 11, 2), {}),
    "base": ((2, 3, 16, 3), {}),
    "large": ((2, 6, 36, 4), dict(embed_dim=144, num_heads=2)),
    "huge": ((4, 8, 60, 8), dict(embed_dim=192, num_heads=3)),
}
CIFAR = dict(img_size=32, patch_size=2, patch_kernel=3, embed_dim=64, num_heads=1, depths=(1, 2, 5),
             mlp_ratio=2.0, stride_kv_adaptive=2)
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_REASONS = {
    "depth": "an MViT's depth is per stage: give depths=(1, 2, 5, 2) to vitflow.create_model",
    "layer_scale_init": "MViTv2 has no LayerScale",
    "patch_drop_rate": "PatchDropout would break the pooling grids",
    "weight_init": "only timm's initialisation ('timm') is implemented",
    "distilled": "no distillation token",
}
_BACKEND_OPTIONS = ("attn_block_size", "attn_window", "linformer_k", "performer_features")  # unused here
_ARGS = {"img_size", "patch_size", "in_chans", "num_classes", "depths", "embed_dim", "num_heads", "mlp_ratio",
         "qkv_bias", "expand_attn", "class_token", "global_pool", "residual_pooling", "kernel_qkv", "stride_q",
         "stride_kv_adaptive", "patch_kernel", "drop_rate", "drop_path_rate", "attention", "cpu_bf16_matmul"}


def _variants() -> dict[str, dict[str, Any]]:
    out = {f"mvitv2_{s}": dict(_BASE, depths=d, **kw) for s, (d, kw) in _SIZES.items()}
    out.update({f"mvitv2_{s}_cls": dict(_BASE, depths=d, class_token=True, **kw) for s, (d, kw) in _CLS.items()})
    out["mvit_v2_s"] = dict(out["mvitv2_small_cls"], stride_kv_adaptive=8, residual_pooling="grid")
    out["mvitv2_cifar_32"] = dict(CIFAR)
    return out


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """Pop the model-config keys an MViT cannot honour (a non-default value raises, naming the key)."""
    pos = kwargs.pop("pos_embed", "learned")
    if pos not in ("learned", "relative"):
        raise ValueError(f"model.pos_embed={pos!r} is not available for MViT models: their position encoding is the "
                         "decomposed relative embedding in each block (leave model.pos_embed at its default)")
    for key, why in _REASONS.items():
        value = kwargs.pop(key, _CONFIG_DEFAULTS[key])
        if value != _CONFIG_DEFAULTS[key]:
            raise ValueError(f"model.{key}={value!r} is not available for MViT models: {why}")
    for key in _BACKEND_OPTIONS:
        kwargs.pop(key, None)
    for key in ("block_heads", "block_mlp_hidden"):
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"{key}: MViT models cannot be head- or MLP-pruned (vitflow prune handles the ViT "
                             "family only)")
    unknown = sorted(k for k in kwargs if k not in _ARGS)
    if unknown:
        raise ValueError(f"unknown argument(s) for MViT models: {', '.join(unknown)}")


def build(grad_checkpointing: str | bool = "none", grad_checkpointing_budget: str | int | None = None,
          **kwargs: Any) -> nn.Module:
    """A :class:`MultiScaleVit` from a variant's arguments plus any keys of
    :class:`~vitflow.config.ModelConfig` (``grad_checkpointing`` and its budget applied after
    construction).

    Raises:
        ValueError: a model-config value MViT cannot honour (named), or bad arguments.
    """
    _refuse_unsupported(kwargs)
    model = MultiScaleVit(**kwargs)
    model.set_grad_checkpointing(grad_checkpointing, grad_checkpointing_budget)
    return model


def summary(args: dict[str, Any]) -> str:
    """A short ``vitflow models`` column for a variant."""
    depths = "-".join(str(d) for d in args["depths"])
    return (f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  depths {depths}"
            + ("  cls" if args.get("class_token") else ""))


def timm_config(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(cfg, model)``: the fields of timm's ``MultiScaleVitCfg`` and the ``MultiScaleVit``
    arguments that build the model ``kwargs`` (a variant's arguments with overrides) describes:
    ``MultiScaleVit(MultiScaleVitCfg(**cfg), **model)`` (``vitflow bench infer``'s baseline for
    variants timm has no name for). Pure data: timm is not imported.

    Raises:
        ValueError: an option timm's MultiScaleVit has no counterpart for (named).
    """
    if kwargs.get("residual_pooling", "all") != "all":
        raise ValueError(f"residual_pooling={kwargs['residual_pooling']!r}: timm's MultiScaleVit adds the residual "
                         "pooling to every token (all)")
    p, k = kwargs.get("patch_size", 4), kwargs.get("patch_kernel") or 2 * kwargs.get("patch_size", 4) - 1
    depths = tuple(kwargs["depths"])
    sq = kwargs.get("stride_q") or (1,) + (2,) * (len(depths) - 1)
    emb, heads = kwargs.get("embed_dim", 96), kwargs.get("num_heads", 1)
    kv = kwargs.get("stride_kv_adaptive", 4)
    cfg = dict(depths=depths, embed_dim=tuple(emb) if isinstance(emb, (list, tuple)) else emb,
               num_heads=tuple(heads) if isinstance(heads, (list, tuple)) else heads,
               mlp_ratio=kwargs.get("mlp_ratio", 4.0), qkv_bias=kwargs.get("qkv_bias", True),
               expand_attn=kwargs.get("expand_attn", True), use_cls_token=kwargs.get("class_token", False),
               kernel_qkv=(kwargs.get("kernel_qkv", 3),) * 2, stride_q=tuple((s, s) for s in sq),
               stride_kv_adaptive=(kv, kv), patch_kernel=(k, k), patch_stride=(p, p), patch_padding=(k // 2, k // 2))
    model = dict(img_size=kwargs.get("img_size", 224), in_chans=kwargs.get("in_chans", 3),
                 num_classes=kwargs.get("num_classes", 1000), global_pool=kwargs.get("global_pool"))
    return cfg, model


MVIT = ModelFamily("mvit", "MViTv2 (Li et al. 2022): multiscale stages with pooling attention",
                   _variants(), build, load_pretrained, summary)
