"""A run's settings taken from its pretrained weights: ``model.name=auto`` (the architecture the
weights' config names) and the preprocessing the weights were trained with (mean, std, input
size, crop fraction, interpolation), unless the user set those keys.

Which keys count as set by the user (``Config.key_origins``, recorded by
:func:`vitflow.config.build_config`): a key from a ``--config`` file, the command line or a
resumed checkpoint's config is explicit and wins. A key set by a *preset* is not explicit for
``data.mean`` / ``data.std`` / ``data.crop_pct`` / ``data.interpolation`` (the normalisation
belongs to the weights, not to the recipe), nor for any ``model.*`` size with
``model.name=auto`` (the preset's sizes describe the preset's model: its architecture keys,
sizes, ``img_size``, ``global_pool``, ``pos_embed``, ``layer_scale_init``, ``distilled``, are
reset to their defaults and left to the weights); a preset's
``model.img_size`` with a named model is explicit (a recipe's resolution, e.g. fine-tuning at
384 px). A :class:`Config` built without ``build_config`` counts its non-default values as
explicit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn

from vitflow.config import ConfigError, DataConfig, ModelConfig, retype_model
from vitflow.models.convert.hf_swin import swin_model_config_keys
from vitflow.models.pretrained.hub import Pretrained, resolve_pretrained
from vitflow.models.registry import MODELS, config_class, create_model

log = logging.getLogger(__name__)

PREPROCESS_KEYS = ("data.mean", "data.std", "data.crop_pct", "data.interpolation", "model.img_size")
SIZE_KEYS = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size")
# a preset's architecture keys describe the preset's model: reset to their defaults under model.name=auto
ARCH_KEYS = (*SIZE_KEYS, "img_size", "global_pool", "pos_embed", "layer_scale_init", "distilled")


def explicit_keys(m: ModelConfig, d: DataConfig, origins: dict[str, str] | None) -> set[str]:
    """The dotted keys the user set explicitly (see the module text for what a preset counts as),
    from ``origins`` (``Config.key_origins``) or, for sections built without ``build_config``
    (``origins=None``), the values that differ from the defaults."""
    auto = m.name == "auto"
    if origins is None:
        sections, defaults = {"model": m, "data": d}, {"model": type(m)(), "data": DataConfig()}
        return {k for k in (*PREPROCESS_KEYS, *(f"model.{s}" for s in SIZE_KEYS))
                if _get(sections, k) != _get(defaults, k)}
    return {k for k, origin in origins.items()
            if not origin.startswith("preset ") or (k == "model.img_size" and not auto)}


def _get(sections: dict[str, Any], key: str) -> Any:
    section, leaf = key.split(".")
    return getattr(sections[section], leaf, None)  # (a family's section lacks some model keys)


def apply_pretrained(m: ModelConfig, d: DataConfig, origins: dict[str, str] | None = None
                     ) -> tuple[ModelConfig, Pretrained | None]:
    """Fill the model and data sections from ``model.pretrained``'s metadata: the architecture for
    ``model.name=auto`` (with the weights' sizes), and ``data.mean/std/crop_pct/interpolation``
    and ``model.img_size`` from its preprocessing, each unless set explicitly (:func:`explicit_keys`;
    ``origins``: ``Config.key_origins``); logs what it took. ``d`` is changed in place; the model
    section is returned as the named family's section class (:func:`vitflow.config.retype_model`: a
    config built without the family's class, or ``auto`` resolved here), changed in place where it
    already was one. Returns ``(model section, the resolved weights or None when there is nothing to
    take: no ``model.pretrained``, or every key set by the user)``; a caller holding the whole config
    sets ``cfg.model`` to the first.

    Raises:
        ConfigError: ``model.name=auto`` without ``model.pretrained`` or without a config naming
        the architecture; an unknown model name; a key the named family does not take.
        ValueError / FileNotFoundError: from :func:`~vitflow.models.pretrained.hub.resolve_pretrained`.
    """
    if m.name != "auto":
        m = retype_model(m, config_class(m.name))
    if not m.pretrained:
        if m.name == "auto":
            raise ConfigError("model.name=auto takes the architecture from model.pretrained's config: set "
                              "model.pretrained", "model.name")
        return m, None
    explicit = explicit_keys(m, d, origins)
    if m.name != "auto" and all(k in explicit for k in PREPROCESS_KEYS):
        return m, None
    pre = resolve_pretrained(m.pretrained)
    auto = m.name == "auto"
    if auto:
        if not pre.model_name:
            raise ConfigError(f"model.name=auto: {m.pretrained} has no config naming an architecture (a snapshot "
                              "folder with config.json or open_clip_config.json); set model.name", "model.name")
        if pre.model_name not in MODELS:
            raise ConfigError(f"model.name=auto: the config of {m.pretrained} names {pre.model_name!r}, which vitflow "
                              "does not build (see vitflow models)", "model.name")
        m.name = pre.model_name
        _reset_preset_arch_keys(m, origins or {})
        m = retype_model(m, config_class(m.name))
        taken = {k: v for k, v in pre.model_kwargs.items() if k in SIZE_KEYS and f"model.{k}" not in explicit}
        if m.name.startswith("swin"):  # stage depths / heads, window: convert_hf_swin
            taken = swin_model_config_keys(pre.model_kwargs, m, explicit)
        for k, v in taken.items():
            setattr(m, k, v)
        log.info("architecture from the weights' config: %s%s", m.name,
                 "".join(f", {k}={v}" for k, v in taken.items()))
    pp = dict(pre.preprocess or {})
    if "img_size" in pre.model_kwargs and "input_size" not in pp and auto:  # the size the config names
        pp["input_size"] = pre.model_kwargs["img_size"]
    _apply_preprocess(m, d, pp, explicit)
    return m, pre


def _reset_preset_arch_keys(m: ModelConfig, origins: dict[str, str]) -> None:
    default = type(m)()
    reset = [k for k in ARCH_KEYS if origins.get(f"model.{k}", "").startswith("preset ") and hasattr(default, k)]
    for k in reset:
        setattr(m, k, getattr(default, k))
    if reset:
        log.info("model.name=auto: the preset's %s left to the weights' architecture", ", ".join(reset))


def create_pretrained_model(spec: str, **overrides: Any) -> tuple[nn.Module, Pretrained]:
    """The model a snapshot folder or ``hf-hub:`` name describes, with its weights: the
    architecture and sizes from its config, ``overrides`` (e.g. ``num_classes=5``: the head is
    then reset) on top. Returns ``(model, resolved)``; ``resolved.preprocess`` is the input
    preprocessing of the weights.

    Raises:
        ValueError: no config naming an architecture, or one vitflow does not build; as
        :func:`vitflow.models.pretrained.weights.load_pretrained`.
    """
    pre = resolve_pretrained(spec)
    if not pre.model_name:
        raise ValueError(f"{spec}: no config naming an architecture (config.json or open_clip_config.json); "
                         "build the model by name and pass pretrained=")
    if pre.model_name not in MODELS:
        raise ValueError(f"{spec}: its config names {pre.model_name!r}, which vitflow does not build "
                         "(see vitflow models)")
    return create_model(pre.model_name, pretrained=spec, **{**pre.model_kwargs, **overrides}), pre


def _apply_preprocess(m: ModelConfig, d: DataConfig, pp: dict[str, Any], explicit: set[str]) -> None:
    kept = []
    values = {"data.mean": pp.get("mean"), "data.std": pp.get("std"), "data.crop_pct": pp.get("crop_pct"),
              "data.interpolation": pp.get("interpolation"), "model.img_size": pp.get("input_size")}
    if values["data.interpolation"] not in (None, "bilinear", "bicubic"):
        log.info("the weights' interpolation %r is not one vitflow resizes with; using %s",
                 values["data.interpolation"], d.interpolation)
        values["data.interpolation"] = None
    for key, value in values.items():
        if value is None:
            continue
        if key in explicit:
            kept.append(key)
            continue
        section, leaf = key.split(".")
        if leaf in ("mean", "std"):
            value = tuple(float(v) for v in value)
            if len(value) != 3:
                raise ValueError(f"model.pretrained={m.pretrained}: {leaf} {list(value)} is not 3 values")
        else:
            value = {"crop_pct": float, "img_size": int}.get(leaf, str)(value)
        setattr({"model": m, "data": d}[section], leaf, value)
    if any(v is not None for v in values.values()):
        size = f"{m.img_size} px" if m.img_size else "the model's size"
        log.info("preprocessing from the weights: mean %s, std %s, %s, crop %s, %s%s", _fmt(d.mean), _fmt(d.std),
                 size, d.crop_pct, d.interpolation, f" (set by you, kept: {', '.join(kept)})" if kept else "")
    try:
        m.validate()
        d.validate()
    except ConfigError as e:
        raise ConfigError(f"{e} (from the weights' preprocessing in {m.pretrained})", e.key) from None


def _fmt(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"

