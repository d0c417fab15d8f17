"""The configuration from Python: :class:`Config`, the typed tree built and validated exactly as
``vitflow train`` builds it, from ``data=``, ``model=``, ``preset=`` and keyword overrides.

An override is a keyword argument naming a dotted key with ``__`` for the dots
(``train__total_steps=300``, ``model__img_size=64``), a dotted key in a dict
(``**{"train.total_steps": 300}``) or a section's dict (``optim={"lr": 1e-3}``). Each becomes the
``key=value`` text of the command line (the value written as YAML and read back, so a Python value
arrives as itself), and the tree is built by the command line's own function
(:func:`vitflow.training.configure.training_config`: the resume, the photo plan, the ``finetune``
preset for weights), with the same checks (:data:`vitflow.training.checks.CONFIG_CHECKS`) and the same
messages, said of "the arguments" instead of "command line".
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from vitflow import config as schema
from vitflow.checkpoint import choose_checkpoint, load_checkpoint
from vitflow.config import ConfigError, all_keys, build_config, check_attributes, flatten
from vitflow.data.sources import pyobjects
from vitflow.models import config_class, list_models
from vitflow.training.checks import CONFIG_CHECKS
from vitflow.training.configure import training_config

ORIGIN = "the arguments"  # what messages call the keyword overrides ("command line" on the CLI)
_SECTIONS = {f.name for f in dataclasses.fields(schema.Config)}


def yaml_value(value: Any) -> str:
    """``value`` as the YAML text that reads back as it (tuples as lists, paths as text)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return text.removesuffix("\n...\n").removesuffix("\n")


def override_items(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{dotted key: value}`` of keyword overrides (module text).

    Raises:
        ConfigError: a keyword that names no section (with the nearest key).
    """
    out: dict[str, Any] = {}
    for name, value in overrides.items():
        key = name.replace("__", ".")
        if "." not in key and isinstance(value, Mapping) and key in _SECTIONS:
            out.update({f"{key}.{k}": v for k, v in flatten(dict(value)).items()})
        elif "." not in key:
            close = [k for k in all_keys() if k.endswith("." + key)]
            hint = f"; did you mean {close[0].replace('.', '__')}=...?" if close else ""
            raise ConfigError(f"{name}={value!r} is not a config key: spell keys section__key=value "
                              f"(train__total_steps=300) or pass a dict{hint}")
        else:
            out[key] = value
    return out


def data_items(data: Any, val: Any = None, test: Any = None) -> dict[str, Any]:
    """The ``data.*`` overrides ``data=`` / ``val=`` / ``test=`` mean: a path (folder, tar, label
    file, dataset, URL) is ``data.path``; Python objects (a Dataset, an iterable, a DataFrame) are
    registered (:func:`vitflow.data.sources.pyobjects.register`) and their key is ``data.path``;
    ``val`` / ``test`` as text are split expressions (``"train[90%:]"``), as objects the held-out
    splits.

    Raises:
        DataError: an object that is not data.
    """
    items: dict[str, Any] = {}
    objects = {role: v for role, v in (("val", val), ("test", test)) if v is not None and not isinstance(v, str)}
    if isinstance(data, (str, os.PathLike)):
        if objects:
            raise ConfigError("val= / test= objects go with Python data (data=Dataset or DataFrame); with a path give "
                              "split expressions: val='train[90%:]'")
        items["data.path"] = os.fspath(data)
    elif data is not None:
        items["data.path"] = pyobjects.register({"train": data, **objects})
        items["data.source"] = "python"
        items.update({f"data.{role}_split": role for role in objects})
    for role, v in (("val", val), ("test", test)):
        if isinstance(v, str):
            items[f"data.{role}_split"] = v
    return items


def model_items(model: Any) -> dict[str, Any]:
    """The ``model.*`` overrides ``model=`` means: a model name (``vitflow models``) is
    ``model.name``; weights (a file, a hub snapshot folder, ``hf-hub:ORG/NAME``) are
    ``model.pretrained``; a vitflow run (a :class:`~vitflow.api.run.Run`, its folder or a checkpoint)
    is its newest checkpoint as ``model.pretrained`` with the run's architecture keys (its
    ``model_args``: name, sizes, patch, pooling, positions)."""
    if model is None:
        return {}
    folder = getattr(model, "folder", None)
    if folder is None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(f"model={type(model).__name__}: give a model name (vitflow models), weights (a file, a hub "
                          "folder, hf-hub:ORG/NAME) or a vitflow run or checkpoint")
    spec = os.fspath(folder if folder is not None else model)
    path = Path(spec).expanduser()
    if spec == "auto" or spec in list_models() or not (path.exists() or spec.startswith("hf-hub:")):
        return {"model.name": spec}  # (an unknown name: the model check names the nearest)
    if (path.is_dir() and (path / "checkpoints").is_dir()) or path.suffix == ".pt":
        ckpt = choose_checkpoint(path, None)
        state = load_checkpoint(ckpt)
        family = schema.Config(model=config_class(state["model_args"]["name"])())  # the run's family's model keys
        known = set(all_keys(family))
        arch = {f"model.{k}": v for k, v in state["model_args"].items()
                if f"model.{k}" in known and k not in ("num_classes", "pretrained") and v is not None}
        return {**arch, "model.pretrained": state["path"]}
    return {"model.pretrained": spec}


def build(data: Any = None, model: Any = None, preset: str | os.PathLike | None = None, val: Any = None,
          test: Any = None, base: schema.Config | None = None, **overrides: Any) -> schema.Config:
    """The validated config of ``vitflow.train(...)``'s arguments (module text): from ``base`` (a
    :class:`Config`, its keys as they were set) or from ``preset`` (a preset name or a YAML file).

    Raises:
        ConfigError: as the command line, said of "the arguments"; DataError: Python data that
            is not data.
    """
    items = {**data_items(data, val, test), **model_items(model), **override_items(overrides)}
    lines = [f"{k}={yaml_value(v)}" for k, v in items.items()]
    try:
        if base is not None:
            check_attributes(base)
            cfg = build_config(base=base.to_dict(), overrides=lines, checks=CONFIG_CHECKS, model_config=config_class)
            if hasattr(base, "key_origins"):  # else, as a tree built by hand: its non-default values count as set
                cfg.key_origins = {**_origins(base), **{k: ORIGIN for k in items}}  # type: ignore[attr-defined]
            else:
                del cfg.key_origins  # type: ignore[attr-defined]
            return cfg
        file = preset if preset is not None and (str(preset).endswith((".yaml", ".yml")) or Path(preset).is_file()) \
            else None
        cfg = training_config(None if file else preset, file, lines, CONFIG_CHECKS)
    except ConfigError as e:
        message = str(e).replace("(in command line)", f"(in {ORIGIN})")
        raise ConfigError(message.replace("(in checkpoint config)", "(set on the Config)") if base is not None
                          else message, e.key) from None
    cfg.key_origins = {k: ORIGIN if v == "command line" else v  # type: ignore[attr-defined]
                       for k, v in getattr(cfg, "key_origins", {}).items()}
    return cfg


def _origins(cfg: schema.Config) -> dict[str, str]:
    """Where each key of ``cfg`` was set; a key changed since by assignment counts as set by the user."""
    origins = dict(getattr(cfg, "key_origins", {}))
    built = getattr(cfg, "_built", None)
    if built is not None:
        now = flatten(yaml.safe_load(schema.to_yaml(cfg)))
        origins.update({k: "assignment" for k, v in now.items() if built.get(k) != v})
    return origins


class Config(schema.Config):
    """The typed configuration tree (a :class:`vitflow.config.Config`: ``cfg.train.total_steps``,
    ``cfg.model.name``, ...), built and validated as ``vitflow train`` builds it::

        cfg = vitflow.Config(data="photos/", model="vit_tiny_patch16_224", preset="finetune",
                             train__total_steps=300)
        cfg.optim.lr = 1e-4              # edit as attributes; vitflow.train(cfg) checks it again
        run = vitflow.train(cfg)

    Args:
        data: as :func:`vitflow.api.train`.
        model: as :func:`vitflow.api.train`.
        preset: as :func:`vitflow.api.train`.
        val: as :func:`vitflow.api.train`.
        test: as :func:`vitflow.api.train`.
        overrides: config keys, as :func:`vitflow.api.train`.
    Raises:
        ConfigError: an unknown preset, file or key (with the nearest valid one), a value of the
            wrong type or out of range (naming the key and where it was set).
    """

    def __init__(self, data: Any = None, model: Any = None, preset: str | os.PathLike | None = None,
                 val: Any = None, test: Any = None, **overrides: Any):
        built = build(data, model, preset, val, test, **overrides)
        self.__dict__.update(built.__dict__)
        self._built = flatten(yaml.safe_load(schema.to_yaml(self)))

    def to_yaml(self) -> str:
        """The tree as YAML (what ``RUN_DIR/config.yaml`` holds)."""
        return schema.to_yaml(self)

    def __repr__(self) -> str:
        return f"vitflow.Config(\n{self.to_yaml()})"
