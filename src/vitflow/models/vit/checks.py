"""The argument checks of :class:`vitflow.models.vit.model.VisionTransformer`: combinations that cannot
work are refused at construction, each with one line naming the argument; and the checks of a ViT
family's ``model`` section that need the model layer (:func:`check_vit_config`)."""

from __future__ import annotations

from vitflow.config import ConfigError, ViTLayoutConfig
from vitflow.models.attention import EXACT_BACKENDS
from vitflow.models.layers import ACT_LAYERS, MLP_LAYERS
from vitflow.models.pool import POOLS
from vitflow.models.position import POS_EMBEDS


def check_options(img_size: int, patch_size: int, global_pool: str, pos_embed: str, class_token: bool,
                  reg_tokens: int, no_embed_class: bool, act_layer: str, mlp_layer: str, depth: int,
                  block_heads: list[int] | None, block_mlp_hidden: list[int] | None,
                  truncate_patches: bool = False) -> None:
    """The :class:`VisionTransformer` arguments that cannot work together, each refused by name.

    Raises:
        ValueError: unknown ``global_pool`` / ``pos_embed`` / ``act_layer`` / ``mlp_layer``, an image size not a
            multiple of the patch, token pooling without a class token, negative ``reg_tokens``,
            prefix tokens the relative position bias cannot place (registers), ``no_embed_class``
            without an absolute position embedding, per-block sizes of the wrong length.
    """
    if global_pool not in POOLS:
        raise ValueError(f"global_pool must be one of {', '.join(POOLS)}, got {global_pool!r}")
    if img_size % patch_size and not truncate_patches:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
    if pos_embed not in POS_EMBEDS:
        raise ValueError(f"pos_embed must be one of {', '.join(POS_EMBEDS)}, got {pos_embed!r}")
    if act_layer not in ACT_LAYERS:
        raise ValueError(f"act_layer must be one of {', '.join(ACT_LAYERS)}, got {act_layer!r}")
    if mlp_layer not in MLP_LAYERS:
        raise ValueError(f"mlp_layer must be one of {', '.join(MLP_LAYERS)}, got {mlp_layer!r}")
    if mlp_layer != "mlp" and block_mlp_hidden is not None:
        raise ValueError(f"block_mlp_hidden (MLP pruning) is not supported with mlp_layer={mlp_layer!r}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool='token' needs the class token (class_token=True); use 'avg' or 'map' without it")
    if reg_tokens < 0:
        raise ValueError(f"reg_tokens must be >= 0, got {reg_tokens}")
    if pos_embed == "relative" and reg_tokens:
        raise ValueError(f"pos_embed='relative' places at most the class token, not {reg_tokens} register tokens "
                         "(reg_tokens): use pos_embed='learned' or 'sincos2d'")
    if pos_embed == "relative" and no_embed_class:
        raise ValueError("no_embed_class needs an absolute position embedding (pos_embed='learned' or 'sincos2d')")
    for name, per_block in (("block_heads", block_heads), ("block_mlp_hidden", block_mlp_hidden)):
        if per_block is not None and (len(per_block) != depth or min(per_block) < 1):
            raise ValueError(f"{name} needs {depth} positive entries (one per block), got {list(per_block)}")


def check_vit_config(m: ViTLayoutConfig) -> None:
    """PatchDropout, token merging and DeiT's distillation token need an attention kernel over any token set
    (an exact one: sparse and linear kernels assume the full grid) and an absolute position
    embedding.

    Raises:
        ConfigError: naming ``model.attention`` or ``model.pos_embed``.
    """
    exact = (*EXACT_BACKENDS, "auto")  # attend over any token set, no grid structure
    distilled = getattr(m, "distilled", False)  # (the vit family's key)
    merge = any(v > 0 for v in (m.token_merge if isinstance(m.token_merge, tuple) else (m.token_merge,)))
    for key, on in (("model.patch_drop_rate", m.patch_drop_rate > 0), ("model.distilled", distilled),
                    ("model.token_merge", merge)):
        if on and m.attention not in exact:
            raise ConfigError(f"model.attention={m.attention!r} is invalid: must be one of {', '.join(exact)} with "
                              f"{key} (sparse and linear kernels assume the full token grid)", "model.attention")
        if on and m.pos_embed == "relative":
            raise ConfigError(f"model.pos_embed={m.pos_embed!r} is invalid: must be learned or sincos2d with {key}",
                              "model.pos_embed")
