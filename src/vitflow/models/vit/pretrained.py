"""The pretrained backbones that share timm's ``VisionTransformer`` layout, as four model
families of :class:`~vitflow.models.vit.model.VisionTransformer` with timm's names and defaults:

- **DeiT III** (Touvron et al. 2022, "DeiT III: Revenge of the ViT"): ``deit3_*``; LayerScale
  (1e-6), position embedding without the class token.
- **DINOv2** (Oquab et al. 2024) and DINOv2 with registers (Darcet et al. 2024, "Vision
  Transformers Need Registers"): ``vit_*_patch14_dinov2``, ``vit_*_patch14_reg4_dinov2``; patch
  14 at 518 px, LayerScale (1e-5), four register tokens outside the position embedding, SwiGLU
  MLP for giant. No classifier (``num_classes=0``, as timm's).
- **CLIP / OpenCLIP image towers** (Radford et al. 2021; Cherti et al. 2023): ``vit_*_clip_*``
  and ``*_clip_quickgelu_*``; a LayerNorm before the blocks (``norm_pre``), no patch-embedding
  bias, LayerNorm epsilon 1e-5, QuickGELU for the OpenAI-style towers. The image projection to
  the joint embedding is the ``head`` (``num_classes`` = the projection width of timm's default
  weights, e.g. 512; the weights part loads CLIP's ``proj`` there).
- **SigLIP / SigLIP 2 image towers** (Zhai et al. 2023; Tschannen et al. 2025):
  ``vit_*_siglip_*``; no class token, attention-pooling (``map``) head, or mean pooling without
  ``fc_norm`` for the ``_gap_`` variants. No classifier (``num_classes=0``).

Every name is one of ``timm.list_models()`` and builds the same module tree, so a timm state_dict
of the same name loads with ``strict=True`` (tests/models/test_pretrained_families.py checks each).
Not registered: timm's DINOv2 / DINOv3 / EVA variants with RoPE (:mod:`vitflow.models` families of
their own), and ViT layouts with ``qk_norm`` or per-layer ``scale_*_norm``.
"""

from __future__ import annotations

from typing import Any

from vitflow.config import ViTLayoutConfig
from vitflow.models.family import ModelFamily
from vitflow.models.pretrained.weights import load_pretrained
from vitflow.models.vit.checks import check_vit_config
from vitflow.models.vit.variants import ARGUMENTS
from vitflow.models.vit.variants import build as build_vit

Sizes = dict[str, tuple[int, int, int, float]]  # size: (embed_dim, depth, num_heads, mlp_ratio)

_DEIT3: Sizes = {"small": (384, 12, 6, 4.0), "medium": (512, 12, 8, 4.0), "base": (768, 12, 12, 4.0),
                 "large": (1024, 24, 16, 4.0), "huge": (1280, 32, 16, 4.0)}
_DINOV2: Sizes = {"small": (384, 12, 6, 4.0), "base": (768, 12, 12, 4.0), "large": (1024, 24, 16, 4.0),
                  "giant": (1536, 40, 24, 2.66667 * 2)}
_CLIP: Sizes = {"xsmall": (256, 10, 4, 4.0), "medium": (512, 12, 8, 4.0), "betwixt": (640, 12, 10, 4.0),
                "base": (768, 12, 12, 4.0), "base_plus": (896, 12, 14, 4.0), "large": (1024, 24, 16, 4.0),
                "huge": (1280, 32, 16, 4.0), "giant": (1408, 40, 16, 48 / 11), "gigantic": (1664, 48, 16, 64 / 13)}
_SIGLIP: Sizes = {"base": (768, 12, 12, 4.0), "large": (1024, 24, 16, 4.0), "so400m": (1152, 27, 16, 3.7362),
                  "giantopt": (1536, 40, 16, 4.0)}

# CLIP towers: (size, patch, img_size, quickgelu, num_classes = timm's default head / projection width)
_CLIP_TOWERS = [
    ("xsmall", 16, 224, False, 512), ("medium", 32, 224, False, 512), ("medium", 16, 224, False, 512),
    ("betwixt", 32, 224, False, 512), ("base", 32, 224, False, 1000), ("base", 32, 256, False, 512),
    ("base", 32, 384, False, 1000), ("base", 32, 448, False, 1000), ("base", 16, 224, False, 1000),
    ("base", 16, 384, False, 1000), ("base_plus", 16, 240, False, 640), ("large", 14, 224, False, 1000),
    ("large", 14, 336, False, 1000), ("huge", 14, 224, False, 1000), ("huge", 14, 336, False, 1000),
    ("huge", 14, 378, False, 1024), ("giant", 14, 224, False, 1024), ("gigantic", 14, 224, False, 1280),
    ("gigantic", 14, 378, False, 1280),
    ("base", 32, 224, True, 512), ("base", 16, 224, True, 512), ("large", 14, 224, True, 768),
    ("large", 14, 336, True, 768), ("huge", 14, 224, True, 1024), ("huge", 14, 378, True, 1024),
    ("gigantic", 14, 224, True, 1280),
]
# SigLIP towers: (size, patch, img_size, gelu_tanh) for the map head; the _gap_ twins follow
_SIGLIP_TOWERS = [
    ("base", 32, 256, True), ("base", 16, 224, False), ("base", 16, 256, False), ("base", 16, 384, False),
    ("base", 16, 512, False), ("large", 16, 256, False), ("large", 16, 384, False), ("large", 16, 512, True),
    ("so400m", 14, 224, False), ("so400m", 14, 378, False), ("so400m", 14, 384, False), ("so400m", 16, 256, True),
    ("so400m", 16, 384, True), ("so400m", 16, 512, True), ("giantopt", 16, 256, True), ("giantopt", 16, 384, True),
]
_SIGLIP_GAP_ONLY = [("so400m", 14, 448, False), ("so400m", 14, 896, False)]


def _size(sizes: Sizes, size: str, **args: Any) -> dict[str, Any]:
    dim, depth, heads, ratio = sizes[size]
    return dict(embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=ratio, **args)


def _deit3() -> dict[str, dict[str, Any]]:
    names = [("small", 16, 224), ("small", 16, 384), ("medium", 16, 224), ("base", 16, 224), ("base", 16, 384),
             ("large", 16, 224), ("large", 16, 384), ("huge", 14, 224)]
    return {f"deit3_{size}_patch{patch}_{img}": _size(_DEIT3, size, img_size=img, patch_size=patch,
                                                      layer_scale_init=1e-6, no_embed_class=True, class_token=True)
            for size, patch, img in names}


def _dinov2() -> dict[str, dict[str, Any]]:
    out = {}
    for size in _DINOV2:
        swiglu = dict(mlp_layer="swiglu_packed") if size == "giant" else {}
        args = _size(_DINOV2, size, img_size=518, patch_size=14, layer_scale_init=1e-5, class_token=True,
                     num_classes=0, **swiglu)
        out[f"vit_{size}_patch14_dinov2"] = args
        out[f"vit_{size}_patch14_reg4_dinov2"] = dict(args, reg_tokens=4, no_embed_class=True)
    return out


def _clip() -> dict[str, dict[str, Any]]:
    out = {}
    for size, patch, img, quick, classes in _CLIP_TOWERS:
        name = f"vit_{size.replace('_plus', '')}_patch{patch}{'_plus' if size.endswith('_plus') else ''}_clip"
        out[f"{name}{'_quickgelu' if quick else ''}_{img}"] = _size(
            _CLIP, size, img_size=img, patch_size=patch, pre_norm=True, norm_eps=1e-5, class_token=True,
            num_classes=classes, act_layer="quick_gelu" if quick else "gelu")
    return out


def _siglip() -> dict[str, dict[str, Any]]:
    out = {}
    for size, patch, img, tanh in _SIGLIP_TOWERS + _SIGLIP_GAP_ONLY:
        args = _size(_SIGLIP, size, img_size=img, patch_size=patch, class_token=False, num_classes=0,
                     act_layer="gelu_tanh" if tanh else "gelu")
        if img % patch:  # so400m/14 at 384: timm's patch embedding drops the last 6 pixels
            args["truncate_patches"] = True
        if (size, patch, img, tanh) not in _SIGLIP_GAP_ONLY:
            out[f"vit_{size}_patch{patch}_siglip_{img}"] = dict(args, global_pool="map")
        out[f"vit_{size}_patch{patch}_siglip_gap_{img}"] = dict(args, global_pool="avg", fc_norm=False)
    return out


def summary(args: dict[str, Any]) -> str:
    """``vitflow models``' columns: size, width, depth, heads, MLP ratio, then what differs from
    the plain ViT (prefix tokens, pooling, norms, activation, LayerScale)."""
    parts = [f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  "
             f"depth {args['depth']:>2}  heads {args['num_heads']:>2}  mlp {args.get('mlp_ratio', 4.0):.4g}"]
    tokens = ("cls" if args.get("class_token", True) else "no cls") + (
        f"+{args['reg_tokens']} reg" if args.get("reg_tokens") else "")
    parts.append(tokens + (" (pos on patches)" if args.get("no_embed_class") else ""))
    pool = args.get("global_pool", "token")
    parts.append("pool " + pool + (" no fc_norm" if pool == "avg" and args.get("fc_norm") is False else ""))
    if args.get("pre_norm"):
        parts.append("pre-norm")
    if args.get("act_layer", "gelu") != "gelu" or args.get("mlp_layer", "mlp") != "mlp":
        parts.append(args.get("mlp_layer") if args.get("mlp_layer", "mlp") != "mlp" else args["act_layer"])
    if args.get("layer_scale_init"):
        parts.append(f"LayerScale {args['layer_scale_init']:g}")
    if args.get("num_classes") is not None:
        parts.append(f"head {args['num_classes']}")
    return "  ".join(parts)


_DESC = "(timm's VisionTransformer layout)"
# the ViT's keys but model.distilled (DeiT's distillation token belongs to the vit family's deit_*_distilled)
_SECTION = dict(config=ViTLayoutConfig, arguments=ARGUMENTS, check_config=check_vit_config)
DEIT3 = ModelFamily("deit3", f"DeiT III (Touvron et al. 2022) {_DESC}", _deit3(), build_vit, load_pretrained, summary,
                    **_SECTION)
DINOV2 = ModelFamily("dinov2", f"DINOv2 (Oquab et al. 2024), with registers (Darcet et al. 2024) {_DESC}",
                     _dinov2(), build_vit, load_pretrained, summary, **_SECTION)
CLIP = ModelFamily("clip", f"CLIP / OpenCLIP image towers (Radford et al. 2021; Cherti et al. 2023) {_DESC}",
                   _clip(), build_vit, load_pretrained, summary, **_SECTION)
SIGLIP = ModelFamily("siglip", f"SigLIP / SigLIP 2 image towers (Zhai et al. 2023; Tschannen et al. 2025) {_DESC}",
                     _siglip(), build_vit, load_pretrained, summary, **_SECTION)
PRETRAINED_FAMILIES: tuple[ModelFamily, ...] = (DEIT3, DINOV2, CLIP, SIGLIP)
