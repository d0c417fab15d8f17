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

Its ``model`` section is :class:`vitflow.config.MViTConfig`: the keys every family takes plus
``depths`` (per stage), ``num_heads`` (the first stage's, doubled per stage: timm's rule; so is
``embed_dim``), ``global_pool`` (``avg``; ``token`` with a class token) and ``attention``
(``sdpa``, ``math``, ``auto``). A ViT's keys (``pos_embed``, ``patch_drop_rate``, ...) are refused
by :func:`vitflow.config.build_config` and :func:`vitflow.create_model`, naming the family's keys.
"""

from __future__ import annotations

import inspect
from typing import Any

from vitflow.config import ConfigError, MViTConfig
from vitflow.models.family import ModelFamily, constructor
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
# what build takes beyond the config's keys: MultiScaleVit's other arguments (in_chans, class_token, ...)
_ARGUMENTS = frozenset(inspect.signature(MultiScaleVit).parameters)


def _variants() -> dict[str, dict[str, Any]]:
    out = {f"mvitv2_{s}": dict(_BASE, depths=d, **kw) for s, (d, kw) in _SIZES.items()}
    out.update({f"mvitv2_{s}_cls": dict(_BASE, depths=d, class_token=True, **kw) for s, (d, kw) in _CLS.items()})
    out["mvit_v2_s"] = dict(out["mvitv2_small_cls"], stride_kv_adaptive=8, residual_pooling="grid")
    out["mvitv2_cifar_32"] = dict(CIFAR)
    out["mvitv2_compact_64"] = dict(CIFAR, img_size=64, patch_size=4, patch_kernel=7)
    return out


build = constructor(MultiScaleVit)  # an MViT from its variant's arguments and MViTConfig's keys


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


def check_mvit_config(m: MViTConfig) -> None:
    """``model.global_pool=token`` names a variant with a class token (the ``*_cls`` ones).

    Raises:
        ConfigError: naming ``model.global_pool`` and the variants that have one.
    """
    if m.global_pool == "token" and not MVIT.variants[m.name].get("class_token"):
        raise ConfigError(f"model.global_pool='token' is invalid: {m.name} has no class token (use avg, or a "
                          "*_cls variant such as mvitv2_small_cls)", "model.global_pool")


MVIT = ModelFamily("mvit", "MViTv2 (Li et al. 2022): multiscale stages with pooling attention",
                   _variants(), build, load_pretrained, summary, config=MViTConfig, arguments=_ARGUMENTS,
                   check_config=check_mvit_config)
