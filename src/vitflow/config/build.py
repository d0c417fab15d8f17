"""Building a :class:`~vitflow.config.schema.Config`: presets, YAML files and dotted
``key=value`` overrides, coerced to the annotated types and validated once, before any work::

    dataclass defaults <- preset YAML <- --config FILE.yaml <- key=value overrides

Every key is checked against the tree: an unknown key fails with the nearest valid one, a value
of the wrong type or out of range fails naming the key and the layer (preset, file, command
line) that set it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from vitflow.config.schema import DEFAULT_PRESET, Config, ConfigError

log = logging.getLogger(__name__)

# keys renamed to the names of vitflow.create_model's arguments; the old names are still read
# (old checkpoints' configs, old command lines), the latter with a warning
RENAMED = {"model.image_size": "model.img_size", "model.layer_scale": "model.layer_scale_init",
           "model.distill_token": "model.distilled"}
Check = Callable[[Any], None]  # a layer's validation of one section (raises ConfigError naming the key)


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


def _nearest(key: str) -> str:
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(key, keys, n=1, cutoff=0.5) or difflib.get_close_matches(
        leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1)
    if close and "." not in close[0]:
        close = [k for k in keys if k.endswith("." + close[0])]
    return f"; did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or the command line) to the annotated type ``tp``.

    Raises:
        ConfigError: ``value`` does not fit ``tp`` (naming ``key``).
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, key)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}={value!r} is invalid: choose one of {list(args)}{hint}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, args, key)
    try:
        return _coerce_scalar(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is invalid: expected {tp.__name__}") from None


def _coerce_union(value: Any, args: tuple, key: str) -> Any:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
        if type(None) in args:
            return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return _coerce(value, arg, key)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{key}: cannot be {value!r}")


def _coerce_tuple(value: Any, args: tuple, key: str) -> tuple:
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value.strip("()[] ")) if v]
    if isinstance(value, (int, float)) and len(args) == 2 and args[1] is Ellipsis:
        value = [value]
    if isinstance(value, (list, tuple)) and len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    if not isinstance(value, (list, tuple)) or len(value) != len(args):
        raise ConfigError(f"{key}={value!r} is invalid: expected {len(args)} values")
    return tuple(_coerce(v, a, key) for v, a in zip(value, args))


def _coerce_scalar(value: Any, tp: type) -> Any:
    """``value`` as a bool, int, float or str. Raises TypeError / ValueError when it is not one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "yes", "1", "on"):
            return True
        if str(value).lower() in ("false", "no", "0", "off"):
            return False
        raise ValueError
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(str(value).replace("_", "")) if isinstance(value, str) else int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError
        return float(str(value).replace("_", "")) if isinstance(value, str) else float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError
        return str(value)
    raise TypeError(f"unsupported type {tp}")


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
            raise ConfigError(f"unknown key {key!r}{_nearest(key)}")
        obj = sub
    hints = typing.get_type_hints(type(obj))
    if leaf not in hints or dataclasses.is_dataclass(getattr(obj, leaf, None)):
        raise ConfigError(f"unknown key {key!r}{_nearest(key)}")
    setattr(obj, leaf, _coerce(value, hints[leaf], key))


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
                 checks: typing.Mapping[str, Check] | None = None) -> Config:
    """Build and validate a :class:`Config`.

    Args:
        preset: preset name (default ``digits-vit-tiny``); ignored when ``base`` is given.
        config_file: a YAML file of sections applied over the preset.
        overrides: ``key=value`` strings applied last.
        base: a full config mapping (e.g. one saved in a checkpoint) used instead of a preset.
        checks: section name -> a layer's validation of that section, run after the config's own
            (e.g. ``{"model": vitflow.models.check_config, "data": vitflow.data.check_config}``);
            their errors name the layer that set the key.
    Returns:
        the config; its ``key_origins`` attribute (not a config key) maps each key set by a layer
        to that layer (``"preset NAME"``, the file's path, ``"command line"``, ``"checkpoint
        config"``), so that later steps can tell user-set keys from presets.
    Raises:
        ConfigError: unknown preset, unreadable file, unknown key or invalid value.
    """
    cfg = Config()
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
    origins: dict[str, str] = {}  # key -> the layer that set it last, to name it in validation errors
    for origin, tree in layers:
        for key, value in flatten(tree).items():
            if key in RENAMED and origin != "checkpoint config":
                log.warning("%s (in %s) is now called %s; please use the new name", key, origin, RENAMED[key])
            try:
                set_key(cfg, key, value)
            except ConfigError as e:
                raise ConfigError(f"{e} (in {origin})") from None
            origins[RENAMED.get(key, key)] = origin
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


def to_yaml(cfg: Config) -> str:
    """The config as YAML (tuples written as lists)."""
    return yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
