"""Constructor arguments between vitflow and timm for a model of the same name.

Every vitflow family outside the plain ``vit`` one registers timm's model names with timm's
configurations (``vit_small_patch14_reg4_dinov2``, ``eva02_tiny_patch14_224``, ...), so timm builds
the same model from the name plus the arguments in which a vitflow model differs from its
registered variant: ``timm.create_model(name, **timm_overrides(variant, kwargs))`` (timm's
entrypoints merge such keyword arguments over their own, ``timm/models/vision_transformer.py``
``_create_vision_transformer``, ``eva.py``, ``beit.py``). These are the keys both libraries name
alike (:data:`SHARED`; vitflow's ``layer_scale_init`` is timm's ``init_values``); options that do
not change what an eval-mode model computes from loaded weights (dropout, initialisation, gradient
checkpointing, the kernel of an exact attention backend) are left out; anything else has no timm
counterpart and is refused by name.

The same table read backwards turns a timm ``config.json``'s ``model_args`` into
:func:`vitflow.create_model` arguments (:func:`vitflow_kwargs`). Pure data: nothing is imported
from the registry (the weights loader reads configs through this module).
"""

from __future__ import annotations

import logging
from typing import Any

from vitflow.config import model_key_defaults
from vitflow.models.attention import EXACT_BACKENDS

TIMM_NAMES = {"layer_scale_init": "init_values"}  # vitflow name -> timm name, where they differ
VITFLOW_NAMES = {v: k for k, v in TIMM_NAMES.items()}
SHARED = ("img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio",
          "qkv_bias", "global_pool", "class_token", "layer_scale_init", "depths", "window_size")  # (Swin: per stage)
# no effect on the function an eval-mode model computes from loaded weights
NEUTRAL = ("drop_rate", "attn_drop_rate", "drop_path_rate", "patch_drop_rate", "weight_init", "grad_checkpointing",
           "grad_checkpointing_budget", "cpu_bf16_matmul", "attn_block_size", "attn_window", "linformer_k",
           "performer_features")
# timm constructor options of a config.json's model_args that change no weights: vitflow's models take
# any input size (a multiple of the patch) and train with the run's own dropout settings
TIMM_RUNTIME = ("dynamic_img_size", "dynamic_img_pad", "drop_rate", "pos_drop_rate", "patch_drop_rate",
                "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "weight_init", "fix_init")
_CONFIG_DEFAULTS = model_key_defaults()  # every family's model.* keys (and the old flat section's) -> default
_UNSET = object()
log = logging.getLogger(__name__)


def timm_overrides(name: str, variant: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """timm keyword arguments that make ``timm.create_model(name, **result)`` build the model that
    ``vitflow.create_model(name, **kwargs)`` builds, for a variant registered with timm's
    configuration ``variant``: the shared keys whose value differs from the variant's (or from the
    model config's default, for keys the variant does not set), under timm's names.

    Args:
        name: the variant's (timm's) name, for messages.
        variant: the registered constructor arguments of ``name``.
        kwargs: the full vitflow arguments (variant plus overrides, e.g. a checkpoint's
            ``model_args`` through :func:`vitflow.models.model_kwargs`; LoRA arguments removed).
    Raises:
        ValueError: an override timm's ``name`` has no argument for (naming the key and value),
            e.g. ``pos_embed``, ``norm_eps``, an approximate ``attention`` kernel, pruned blocks.
    """
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        base = variant[key] if key in variant else _CONFIG_DEFAULTS.get(key, _UNSET)
        if value == base or value is None or key in NEUTRAL or (key == "attention" and value in (*EXACT_BACKENDS,
                                                                                                  "auto")):
            continue
        if key not in SHARED:
            raise ValueError(f"model.{key}={value!r}: timm's {name} has no such option, so timm cannot rebuild this "
                             f"model (it takes {', '.join(SHARED)} beside the name)")
        out[TIMM_NAMES.get(key, key)] = value
    return out


def vitflow_kwargs(timm_args: dict[str, Any], source: str) -> dict[str, Any]:
    """:func:`vitflow.create_model` arguments from timm's ``model_args`` (a ``config.json``'s):
    the shared keys, ``init_values`` read as ``layer_scale_init``.

    timm's run-time options that change no weights (:data:`TIMM_RUNTIME`: dynamic input sizes,
    dropout rates, initialisation) are left out with a log line.

    Raises:
        ValueError: a key vitflow has no equivalent for (naming ``source`` and the keys).
    """
    ignored = sorted(k for k in timm_args if k in TIMM_RUNTIME)
    if ignored:
        log.info("%s: model_args %s change no weights; vitflow takes any input size and trains with its own "
                 "dropout settings", source, ignored)
    timm_args = {k: v for k, v in timm_args.items() if k not in TIMM_RUNTIME}
    unknown = sorted(k for k in timm_args if VITFLOW_NAMES.get(k, k) not in SHARED)
    if unknown:
        known = sorted(TIMM_NAMES.get(k, k) for k in SHARED)
        raise ValueError(f"{source}: model_args {unknown}: no vitflow equivalent (vitflow reads {', '.join(known)})")
    return {VITFLOW_NAMES.get(k, k): v for k, v in timm_args.items()}
