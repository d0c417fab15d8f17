"""The EVA-02 and DINOv3 families (:class:`~vitflow.models.eva.model.Eva`) with timm's model names and
configurations, and the build shared with BEiT (:func:`build`); their ``model`` section is
:class:`vitflow.config.EvaConfig`.

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

import inspect
from typing import Any

from vitflow.config import EvaConfig
from vitflow.models.eva.model import Eva
from vitflow.models.family import ModelFamily, constructor
from vitflow.models.pretrained.weights import load_pretrained

# what build takes beyond the config's keys: Eva's other arguments (rope, mlp, qkv_fused, ...)
ARGUMENTS = frozenset(inspect.signature(Eva).parameters)


build = constructor(Eva)  # an EVA-02 / DINOv3 / BEiT model from its variant's arguments and EvaConfig's keys


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
                    _eva02_variants(), build, load_pretrained, summary, config=EvaConfig, arguments=ARGUMENTS)
DINOV3 = ModelFamily("dinov3", "DINOv3 (Simeoni et al. 2025): registers, DINOv3 2-D RoPE, LayerScale",
                     _dinov3_variants(), build, load_pretrained, summary, config=EvaConfig, arguments=ARGUMENTS)
