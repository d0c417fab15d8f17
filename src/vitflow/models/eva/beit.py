"""The BEiT family (Bao et al. 2022, "BEiT: BERT Pre-Training of Image Transformers"; BEiT v2,
Peng et al. 2022) with timm's names: :class:`~vitflow.models.eva.model.Eva` configured as timm's ``Beit``.

Every block has its own relative position bias (``blocks.{i}.attn.relative_position_bias_table``,
``(2h-1)(2w-1) + 3`` rows: the patch offsets, then class->patch, patch->class, class->class) and
no absolute position embedding; LayerScale ``gamma_1`` / ``gamma_2`` (0.1 for BEiT-Base, 1e-5
otherwise); q/v bias without a key bias; GELU MLP; mean pooling of the patch tokens with
``fc_norm``. Another input size resamples each table bicubically; ``model.global_pool=token``
pools the class token through ``norm`` instead.
"""

from __future__ import annotations

from typing import Any

from vitflow.config import EvaConfig
from vitflow.models.eva.variants import ARGUMENTS, build, summary
from vitflow.models.family import ModelFamily
from vitflow.models.pretrained.weights import load_pretrained

_SIZES = {"base": (768, 12, 12), "large": (1024, 24, 16)}


def _variants() -> dict[str, dict[str, Any]]:
    common = dict(patch_size=16, abs_pos_embed=False, rel_pos_bias=True, qkv_bias=True, mlp="gelu", mlp_ratio=4.0)
    out: dict[str, dict[str, Any]] = {}
    for name, size, img, ls in (("beit_base_patch16_224", "base", 224, 0.1), ("beit_base_patch16_384", "base", 384, 0.1),
                                ("beit_large_patch16_224", "large", 224, 1e-5),
                                ("beit_large_patch16_384", "large", 384, 1e-5),
                                ("beit_large_patch16_512", "large", 512, 1e-5),
                                ("beitv2_base_patch16_224", "base", 224, 1e-5),
                                ("beitv2_large_patch16_224", "large", 224, 1e-5)):
        dim, depth, heads = _SIZES[size]
        out[name] = dict(img_size=img, embed_dim=dim, depth=depth, num_heads=heads, layer_scale_init=ls, **common)
    return out


BEIT = ModelFamily("beit", "BEiT / BEiT v2 (Bao et al. 2022; Peng et al. 2022): per-block relative position bias, "
                   "LayerScale, q/v bias", _variants(), build, load_pretrained, summary, config=EvaConfig,
                   arguments=ARGUMENTS)
