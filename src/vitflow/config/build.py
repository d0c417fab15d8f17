"""Building a :class:`~vitflow.config.schema.Config`: presets, YAML files and dotted
``key=value`` overrides, coerced to the annotated types and validated once, before any work::

    dataclass defaults <- preset YAML <- --config FILE.yaml <- key=value overrides

Every key is checked against the tree: an unknown key fails with the nearest valid one, a value
of the wrong type or out of range fails naming the key and the layer (preset, file, command
line) that set it.

The ``model`` section is the class of the final ``model.name``'s family (the model layer tells
which: ``build_config(..., model_config=vitflow.models.config_class)``): every layer is read
first for the final name, then that class is filled. A key of another family is refused naming
the family and its keys; a preset's such keys (a recipe for another family) are left out, and
those of an old checkpoint's flat section when they hold their defaults
(:mod:`.model_keys`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from vitflow.config.coerce import coerce
from vitflow.config.model_keys import field_names, holds_old_default, is_model_key, not_a_key
from vitflow.config.model_schema import ModelConfig, ViTConfig
from vitflow.config.schema import DEFAULT_PRESET, Config, ConfigError

log = logging.getLogger(__name__)

# keys renamed to the names of vitflow.create_model's arguments; the old names are still read
# (old checkpoints' configs, old command lines), the latter with a warning
RENAMED = {"model.image_size": "model.img_size", "model.layer_scale": "model.layer_scale_init",
           "model.distill_token": "model.distilled"}
Check = Callable[[Any], None]  # a layer's validation of one section (raises ConfigError naming the key)
# the model layer's choice of the model section's class: (model.name, model.pretrained) -> the family's class
# (raises ConfigError for an unknown name); vitflow.models.config_class
ModelConfigClass = Callable[[str, "str | None"], type[ModelConfig]]


def all_keys(obj: Any = None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the tree, e.g. ``"train.batch_size"``."""
    obj = Config() if obj is None else obj
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _nearest(key: str, cfg: Config | None = None) -> str:
    keys = all_keys(cfg)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(key, keys, n=1, cutoff=0.5) or difflib.get_close_matches(
        leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1)
    if close and "." not in close[0]:
        close = [k for k in keys if k.endswith("." + close[0])]
    return f"; did you mean {close[0]!r}?" if close else ""


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set dotted ``key`` on ``cfg`` after coercing ``value`` to the field's type.

    A key renamed since (:data:`RENAMED`, e.g. ``model.image_size``) sets its new name.

    Raises:
        ConfigError: unknown key (with the nearest valid one) or a value of the wrong type.
    """
    key = RENAMED.get(key, key)
    *path, leaf = key.split(".")
    obj = cfg
    for part in path:
        sub = getattr(obj, part, None)
        if not dataclasses.is_dataclass(sub):
            raise ConfigError(f"unknown key {key!r}{_nearest(key, cfg)}")
        obj = sub
    if leaf not in {f.name for f in dataclasses.fields(obj)} or dataclasses.is_dataclass(getattr(obj, leaf)):
        raise ConfigError(f"unknown key {key!r}{_nearest(key, cfg)}")
    setattr(obj, leaf, coerce(value, typing.get_type_hints(type(obj))[leaf], key))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 3e-4)`` (the value is read as YAML).

    Raises:
        ConfigError: no ``=`` in ``text``.
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# ---------------------------------------------------------------------------------------------
# presets and files


def list_presets() -> dict[str, str]:
    """``{preset name: description}`` for every YAML shipped in ``vitflow/presets``."""
    out = {}
    for entry in sorted(resources.files("vitflow.presets").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".yaml"):
            out[entry.name[:-5]] = (yaml.safe_load(entry.read_text()) or {}).get("description", "")
    return out


def _read_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{origin}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(tree).__name__}")
    return tree


def preset_tree(name: str) -> dict[str, Any]:
    """The raw YAML mapping of preset ``name``.

    Raises:
        ConfigError: no such preset (with the nearest names).
    """
    presets = list_presets()
    if name not in presets:
        close = difflib.get_close_matches(name, presets, n=2)
        raise ConfigError(f"unknown preset {name!r}" + (f"; did you mean {', '.join(close)}?" if close
                                                         else f"; available: {', '.join(presets)}"))
    return _read_yaml(resources.files("vitflow.presets").joinpath(f"{name}.yaml").read_text(), f"preset {name}")


def build_config(preset: str | None = None, config_file: str | Path | None = None,
                 overrides: typing.Sequence[str] = (), base: dict[str, Any] | None = None,
                 checks: typing.Mapping[str, Check] | None = None,
                 model_config: ModelConfigClass | None = None) -> Config:
    """Build and validate a :class:`Config`.

    Args:
        preset: preset name (default ``digits-vit-tiny``); ignored when ``base`` is given.
        config_file: a YAML file of sections applied over the preset.
        overrides: ``key=value`` strings applied last.
        base: a full config mapping (e.g. one saved in a checkpoint) used instead of a preset.
        checks: section name -> a layer's validation of that section, run after the config's own
            (e.g. ``{"model": vitflow.models.check_config, "data": vitflow.data.check_config}``);
            their errors name the layer that set the key.
        model_config: the model layer's class for the final ``model.name`` (and
            ``model.pretrained``, for ``auto``): :func:`vitflow.models.config_class`; without it the
            section is a :class:`~vitflow.config.ViTConfig` (the default family's).
    Returns:
        the config; its ``key_origins`` attribute (not a config key) maps each key set by a layer
        to that layer (``"preset NAME"``, the file's path, ``"command line"``, ``"checkpoint
        config"``), so that later steps can tell user-set keys from presets.
    Raises:
        ConfigError: unknown preset, unreadable file, unknown key, a key of another model family
        or invalid value.
    """
    layers = _layers(preset, config_file, overrides, base)
    cfg = Config(model=_model_class(layers, model_config)())
    name = _final(layers, "model.name", ModelConfig.name)
    origins: dict[str, str] = {}  # key -> the layer that set it last, to name it in validation errors
    for origin, tree in layers:
        for key, value in tree.items():
            try:
                if _foreign_model_key(cfg, key, value, origin, name):
                    continue
                set_key(cfg, key, value)
            except ConfigError as e:
                raise ConfigError(f"{e} (in {origin})", e.key) from None
            origins[key] = origin
    try:
        cfg.validate()
        for section, check in (checks or {}).items():
            check(getattr(cfg, section))
    except ConfigError as e:
        if e.key in origins:
            raise ConfigError(f"{e} (in {origins[e.key]})", e.key) from None
        raise
    cfg.key_origins = origins  # type: ignore[attr-defined]  # read by vitflow.models.pretrained.config
    return cfg


def _layers(preset: str | None, config_file: str | Path | None, overrides: typing.Sequence[str],
            base: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """``(origin, flat keys)`` of each layer in order, renamed keys under their new names (the
    old names from a preset, file or command line logged with a warning)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if base is not None:
        layers.append(("checkpoint config", base))
    else:
        preset = preset or DEFAULT_PRESET
        layers.append((f"preset {preset}", {"preset": preset, **preset_tree(preset)}))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        layers.append((str(path), _read_yaml(path.read_text(), str(path))))
    layers.append(("command line", dict(parse_override(o) for o in overrides)))
    out = []
    for origin, tree in layers:
        flat = flatten(tree)
        for key in [k for k in flat if k in RENAMED]:
            if origin != "checkpoint config":
                log.warning("%s (in %s) is now called %s; please use the new name", key, origin, RENAMED[key])
        out.append((origin, {RENAMED.get(k, k): v for k, v in flat.items()}))
    return out


def _final(layers: list[tuple[str, dict[str, Any]]], key: str, default: Any) -> Any:
    """The value the last layer that sets ``key`` gives it (``default`` when none does)."""
    return next((tree[key] for _, tree in reversed(layers) if key in tree), default)


def _model_class(layers: list[tuple[str, dict[str, Any]]], model_config: ModelConfigClass | None
                 ) -> type[ModelConfig]:
    """The model section's class for the layers' final ``model.name`` / ``model.pretrained``."""
    if model_config is None:
        return ViTConfig
    name = _final(layers, "model.name", ModelConfig.name)
    pretrained = _final(layers, "model.pretrained", None)
    try:
        return model_config(str(name), None if pretrained is None else str(pretrained))
    except ConfigError as e:
        origin = next((o for o, tree in reversed(layers) if "model.name" in tree), None)
        raise ConfigError(f"{e} (in {origin})" if origin else str(e), e.key) from None


def _foreign_model_key(cfg: Config, key: str, value: Any, origin: str, name: Any) -> bool:
    """Whether ``model.LEAF`` is a key of another family than the section's and is left out: a
    preset's (a recipe written for another family; logged) or an old checkpoint's holding its
    default (:func:`~vitflow.config.model_keys.holds_old_default`).

    Raises:
        ConfigError: any other key of another family (one line naming the family and its keys).
    """
    section, _, leaf = key.partition(".")
    cls = type(cfg.model)
    if section != "model" or "." in leaf or leaf in field_names(cls) or not is_model_key(leaf):
        return False
    if origin.startswith("preset "):
        log.info("model.%s=%r (%s) is not a key of %s models: left out", leaf, value, origin, cls.label)
        return True
    if origin == "checkpoint config" and holds_old_default(leaf, value):
        return True
    raise not_a_key(leaf, cls, name)


def to_yaml(cfg: Config) -> str:
    """The config as YAML (tuples written as lists)."""
    return yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
