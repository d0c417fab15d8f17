"""The model-family registry: ``create_model``, ``list_models``, each name's ``model`` section
class (:func:`config_class`) and the model config's checks.

Each family (:class:`~vitflow.models.family.ModelFamily`) owns a set of variant names and its
``model`` section; :func:`create_model` finds the family that owns a name and builds the variant
with the given overrides. Families today: ViT / DeiT and the pretrained families in its layout
(:mod:`vitflow.models.vit`), EVA-02 / DINOv3 / BEiT (:mod:`vitflow.models.eva`), Swin
(:mod:`vitflow.models.swin`); a new architecture adds its family to :data:`FAMILIES`.
"""

from __future__ import annotations

import difflib
import fnmatch
from pathlib import Path
from typing import Any

import torch.nn as nn

from vitflow.config import ConfigError, ModelConfig, ViTConfig, field_names, holds_old_default, retype_model
from vitflow.models.eva.beit import BEIT
from vitflow.models.eva.variants import DINOV3, EVA02
from vitflow.models.family import ModelFamily
from vitflow.models.grad_checkpointing import CheckpointPlan
from vitflow.models.mvit.variants import MVIT
from vitflow.models.pretrained.hub import offline_model_name
from vitflow.models.swin.variants import SWIN
from vitflow.models.vit.pretrained import PRETRAINED_FAMILIES
from vitflow.models.vit.variants import VIT

FAMILIES: tuple[ModelFamily, ...] = (VIT, *PRETRAINED_FAMILIES, BEIT, EVA02, DINOV3, SWIN, MVIT)
MODELS: dict[str, dict[str, Any]] = {name: args for f in FAMILIES for name, args in f.variants.items()}


def family_of(name: str) -> ModelFamily:
    """The family that owns variant ``name``.

    Raises:
        ValueError: unknown variant (the message names the closest registered ones).
    """
    for family in FAMILIES:
        if name in family.variants:
            return family
    close = difflib.get_close_matches(name, MODELS, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see vitflow.list_models()"
    raise ValueError(f"unknown model {name!r}{hint}")


def list_models(pattern: str | None = None, family: str | None = None) -> list[str]:
    """Sorted registered variant names, optionally filtered by a shell-style ``pattern``
    (e.g. ``"vit_small_*"``) and a family name (``"vit"``)."""
    names = sorted(n for f in FAMILIES if family in (None, f.name) for n in f.variants)
    return [n for n in names if fnmatch.fnmatch(n, pattern)] if pattern else names


def model_kwargs(name: str, **overrides: Any) -> dict[str, Any]:
    """Constructor arguments of variant ``name`` with ``overrides`` applied (``None`` values are
    ignored).

    Raises:
        ValueError: unknown variant (the message names the closest registered ones).
    """
    return {**family_of(name).variants[name], **{k: v for k, v in overrides.items() if v is not None}}


def config_class(name: str, pretrained: str | None = None) -> type[ModelConfig]:
    """The ``model`` section class of variant ``name`` (its family's ``config``). For
    ``name="auto"`` the architecture ``pretrained``'s config names, when that config can be read
    here without the network (a folder, a cached ``hf-hub:`` snapshot); else
    :class:`~vitflow.config.ViTConfig`, re-typed once the weights are read
    (:func:`vitflow.models.pretrained.config.apply_pretrained`). Pass it to
    :func:`vitflow.config.build_config` as ``model_config``.

    Raises:
        ConfigError: unknown ``name`` (naming the nearest registered ones).
    """
    if name == "auto":
        named = offline_model_name(pretrained) if pretrained else None
        return family_of(named).config if named in MODELS else ViTConfig
    if name not in MODELS:
        raise _unknown(name)
    return family_of(name).config


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, MODELS, n=3)
    return ConfigError(f"model.name: unknown model {name!r}"
                       + (f"; did you mean {', '.join(close)}?" if close else "; see `vitflow models`"), "model.name")


def _accepted(family: ModelFamily, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` without the keys ``family`` lacks that hold their old defaults (a flat ``model``
    section of older checkpoints, :func:`vitflow.config.holds_old_default`).

    Raises:
        ValueError: any other argument the family does not take (naming them and the keys it takes).
    """
    accepted = family.accepts()
    unknown = {k: v for k, v in args.items() if k not in accepted and not holds_old_default(k, v)}
    if unknown:
        keys = [k for k in field_names(family.config) if k not in ("name", "pretrained")]
        given = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
        raise ValueError(f"unknown argument(s) for {family.name} models: {given} (their model.* keys: "
                         f"{', '.join(keys)})")
    return {k: v for k, v in args.items() if k in accepted}


def create_model(name: str, pretrained: str | Path | None = None, **overrides: Any) -> nn.Module:
    """Build a registered variant, optionally loading weights.

    Args:
        name: a name from :func:`list_models`.
        pretrained: a weights file (``.safetensors``, ``.pt``/``.pth``/``.bin`` state dict or
            vitflow checkpoint, ``.npz``; timm, Hugging Face, OpenCLIP or big_vision names
            converted), a hub snapshot folder or ``hf-hub:ORG/NAME[@rev]``
            (:func:`vitflow.models.pretrained.hub.resolve_pretrained`). A head of another class count is
            reset; a position embedding of another grid is resampled bicubically.
        **overrides: constructor arguments (for ViT: ``num_classes``, ``img_size``,
            ``drop_path_rate``, ``attention``, ..., ``distilled=True`` for DeiT's distilled ViT,
            ``grad_checkpointing``); ``None`` values are ignored. These are the names of the
            family's ``model`` section (:func:`config_class`) and of its model's constructor; the
            keys of an older flat section that the family lacks are ignored at their old defaults.
    Raises:
        ValueError: unknown name, an argument the family does not take (naming it and the
        family's keys), invalid arguments or incompatible weights; FileNotFoundError: missing
        weights file.
    """
    family = family_of(name)
    model = family.build(**_accepted(family, model_kwargs(name, **overrides)))
    if pretrained is not None:
        if family.load_pretrained is None:
            raise ValueError(f"model family {family.name!r} reads no pretrained weights")
        family.load_pretrained(model, pretrained)
    return model


def check_config(m: ModelConfig) -> None:
    """The model section's checks that need the registry (variant names, the variant's patch
    size) and the model layer (checkpointing specs; the family's own, e.g. which attention
    backends take any token set).

    Raises:
        ConfigError: naming the key and, for a name, the nearest registered ones.
    """
    if m.name == "auto":  # the architecture named by model.pretrained's config, checked once it is read
        if not m.pretrained:
            raise ConfigError("model.name=auto takes the architecture from model.pretrained's config: set "
                              "model.pretrained", "model.name")
        return
    if m.name not in MODELS:
        raise _unknown(m.name)
    size = m.img_size or MODELS[m.name].get("img_size", 224)
    patch = m.patch_size or MODELS[m.name].get("patch_size", 16)
    if size % patch and not MODELS[m.name].get("truncate_patches"):
        raise ConfigError(f"model.img_size={size!r} is invalid: must be a multiple of the patch size {patch}",
                          "model.img_size")
    try:
        CheckpointPlan.parse(m.grad_checkpointing, m.grad_checkpointing_budget)
    except ValueError as e:
        raise ConfigError(f"model.grad_checkpointing: {e}", "model.grad_checkpointing") from None
    family = family_of(m.name)
    m = retype_model(m, family.config)  # a section built without the family's class: its keys, or a refusal
    if family.check_config is not None:
        family.check_config(m)


def model_args(m: ModelConfig, num_classes: int) -> dict[str, Any]:
    """The :func:`create_model` arguments of a model config (saved in checkpoints as
    ``model_args``): the section's fields as they are, without ``pretrained`` (the weights travel
    in the checkpoint) and with the class count found in the data."""
    args = {k: v for k, v in vars(m).items() if k != "pretrained"}
    args["num_classes"] = num_classes
    if getattr(m, "distilled", False) and m.global_pool is None:  # the distillation token needs token pooling
        args["global_pool"] = "token"
    return args
