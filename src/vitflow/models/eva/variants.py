"""The EVA-02 and DINOv3 families (:class:`~vitflow.models.eva.model.Eva`) with timm's model names and
configurations, and the model-config handling shared with BEiT (:func:`make_build`).

- EVA-02 (Fang et al. 2023, "EVA-02: A Visual Representation for Neon Genesis"): patch 14,
  learned position embedding plus 2-D RoPE rescaled to the 16x16 pretraining grid, SwiGLU MLP
  (packed for tiny / small; split with sub-LN for base / large), q/v bias, mean pooling with
  ``fc_norm``; the EVA-02 CLIP image towers add a norm inside the attention and pool the class
  token into a projection head (512 / 768 outputs).
- DINOv3 (Simeoni et al. 2025): patch 16, class token and 4 registers, DINOv3's RoPE (centred
  coordinates, periods ``100 ** (2i / (d/2))``), no absolute position embedding, LayerScale 1e-5,
  LayerNorm eps 1e-5, the final ``norm`` before pooling (timm's default pooling is the mean of the
  patch tokens; ``global_pool="token"`` gives upstream's class token); ``_qkvb`` names carry the
  q/v bias, the others have no qkv bias; ``plus`` models use an aligned SwiGLU.

Default image sizes and class counts are those of timm's default pretrained configuration
(DINOv3: 256 px, no head; EVA-02 ``*_224``: no head).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch.nn as nn

from vitflow.config import ModelConfig
from vitflow.models.eva.model import Eva
from vitflow.models.family import ModelFamily
from vitflow.models.pretrained.weights import load_pretrained

# ModelConfig keys that are Eva constructor arguments as they are
_DIRECT = ("img_size", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "global_pool",
           "attention", "attn_block_size", "layer_scale_init", "drop_rate", "drop_path_rate", "cpu_bf16_matmul")
# options of attention backends these models refuse (the refusal names model.attention)
_BACKEND_OPTIONS = ("attn_window", "linformer_k", "performer_features")
_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
_EVA_ARGS = set(inspect.signature(Eva).parameters)


def _refuse_unsupported(family: str, own_pos_embed: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    """Pop the model-config keys these families cannot honour; a non-default value raises."""
    pos = kwargs.pop("pos_embed", "learned")
    if pos not in ("learned", *own_pos_embed):
        raise ValueError(f"model.pos_embed={pos!r} is not available for {family} models: their position encoding is "
                         f"fixed by the architecture (leave model.pos_embed at its default)")
    reasons = {"patch_drop_rate": "PatchDropout would have to carry the RoPE / relative-bias positions of the kept "
                                  "tokens", "weight_init": "only timm's initialisation ('timm') is implemented",
               "distilled": "no distillation token"}
    for key, why in reasons.items():
        value = kwargs.pop(key, _CONFIG_DEFAULTS[key])
        if value != _CONFIG_DEFAULTS[key]:
            raise ValueError(f"model.{key}={value!r} is not available for {family} models: {why}")
    for key in _BACKEND_OPTIONS:
        kwargs.pop(key, None)
    for key in ("block_heads", "block_mlp_hidden"):
        if kwargs.pop(key, None) is not None:
            raise ValueError(f"{key}: {family} models cannot be head- or MLP-pruned (vitflow prune handles the ViT "
                             "family only)")
    unknown = sorted(k for k in kwargs if k not in _CONFIG_DEFAULTS and k not in _EVA_ARGS)
    if unknown:
        raise ValueError(f"unknown argument(s) for {family} models: {', '.join(unknown)}")
    for key in list(kwargs):
        if key in _CONFIG_DEFAULTS and key not in _DIRECT:
            value = kwargs.pop(key)
            if value != _CONFIG_DEFAULTS[key]:
                raise ValueError(f"model.{key}={value!r} is not available for {family} models")


def make_build(family: str, own_pos_embed: tuple[str, ...] = ()) -> Callable[..., nn.Module]:
    """A family ``build(**kwargs)``: an :class:`Eva` from a variant's arguments plus any keys of
    :class:`~vitflow.config.ModelConfig` (``grad_checkpointing`` and its budget applied after
    construction). ``model.pos_embed`` may stay at its default ``learned`` (meaning the family's
    own encoding) or name ``own_pos_embed``.

    Raises:
        ValueError: a model-config value the family cannot honour (named), or bad arguments.
    """
    def build(grad_checkpointing: str | bool = "none", grad_checkpointing_budget: str | int | None = None,
              **kwargs: Any) -> nn.Module:
        _refuse_unsupported(family, own_pos_embed, kwargs)
        model = Eva(**kwargs)
        model.set_grad_checkpointing(grad_checkpointing, grad_checkpointing_budget)
        return model

    build.__doc__ = f"A {family} model (:class:`vitflow.models.eva.model.Eva`) from its variant and model-config arguments."
    return build


def summary(args: dict[str, Any]) -> str:
    """A short ``vitflow models`` column for a variant."""
    extras = [args.get("mlp", "gelu") + (" sub-LN" if args.get("sub_ln") else "")]
    extras += [f"RoPE {args['rope']}"] if args.get("rope") else []
    extras += ["rel-pos bias"] if args.get("rel_pos_bias") else []
    extras += [f"{args['num_reg_tokens']} reg"] if args.get("num_reg_tokens") else []
    extras += ["qkv bias"] if args.get("qkv_bias", True) else []
    return (f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  "
            f"depth {args['depth']:>2}  heads {args['num_heads']:>2}  " + ", ".join(extras))


_EVA02_SIZES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16)}


def _eva02_variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    common = dict(mlp_ratio=4 * 2 / 3, rope="eva", rope_ref_grid=(16, 16), rope_temperature=10000.0)
    for size, sizes in (("tiny", (224, 336)), ("small", (224, 336)), ("base", (224, 448)), ("large", (224, 448))):
        dim, depth, heads = _EVA02_SIZES[size]
        split = size in ("base", "large")  # separate q/k/v projections, SwiGLU with sub-LN
        arch = dict(patch_size=14, embed_dim=dim, depth=depth, num_heads=heads, qkv_fused=not split,
                    mlp="swiglu" if split else "swiglu_packed", sub_ln=split, **common)
        for img in sizes:
            out[f"eva02_{size}_patch14_{img}"] = dict(img_size=img, **arch, **({"num_classes": 0} if img == 224 else {}))
    clip = dict(qkv_fused=False, mlp="swiglu", sub_ln=True, attn_inner_norm=True, global_pool="token", **common)
    out["eva02_base_patch16_clip_224"] = dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                              num_classes=512, **clip)
    for img in (224, 336):
        out[f"eva02_large_patch14_clip_{img}"] = dict(img_size=img, patch_size=14, embed_dim=1024, depth=24,
                                                      num_heads=16, num_classes=768, **clip)
    return out


_DINOV3_SIZES = {  # name: (embed_dim, depth, heads, swiglu)
    "small": (384, 12, 6, False), "small_plus": (384, 12, 6, True), "base": (768, 12, 12, False),
    "large": (1024, 24, 16, False), "huge_plus": (1280, 32, 20, True), "tiny": (192, 12, 3, False),
}


def _dinov3_variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    common = dict(img_size=256, patch_size=16, num_classes=0, num_reg_tokens=4, abs_pos_embed=False, rope="dinov3",
                  rope_temperature=100.0, layer_scale_init=1e-5, norm_eps=1e-5, use_fc_norm=False)
    for size, (dim, depth, heads, swiglu) in _DINOV3_SIZES.items():
        mlp = dict(mlp="swiglu", swiglu_align_to=8) if swiglu else {}
        for qkvb in (False, True):
            if size == "tiny" and not qkvb:  # timm has the tiny model with qkv bias only
                continue
            name = f"vit_{size}_patch16_dinov3" + ("_qkvb" if qkvb else "")
            out[name] = dict(embed_dim=dim, depth=depth, num_heads=heads, qkv_bias=qkvb, **mlp, **common)
    return out


EVA02 = ModelFamily("eva02", "EVA-02 (Fang et al. 2023): 2-D RoPE, SwiGLU, sub-LN; EVA-02 CLIP image towers",
                    _eva02_variants(), make_build("eva02"), load_pretrained, summary)
DINOV3 = ModelFamily("dinov3", "DINOv3 (Simeoni et al. 2025): registers, DINOv3 2-D RoPE, LayerScale",
                     _dinov3_variants(), make_build("dinov3"), load_pretrained, summary)
