"""A sweep's search space: a YAML file mapping config keys to Optuna distributions, and a trial's
values of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from vitflow.config import all_keys, model_key_defaults
from vitflow.metrics import split_metric

TYPES = ("float", "int", "categorical")
FIELDS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
          "categorical": {"type", "choices"}}


class SweepError(ValueError):
    """The sweep cannot run as asked; the message names the file, key, option or storage."""


def default_direction(metric: str) -> str:
    """``minimize`` for a figure the metric table says is better lower (``val_loss``, ``val_ece``),
    else ``maximize``."""
    found = split_metric(metric)
    return "minimize" if found and found[1].better == "min" else "maximize"


def read_space(path: str | Path) -> dict[str, dict[str, Any]]:
    """The search space of a YAML file: config key -> ``{type: float|int, low, high[, log, step]}``
    or ``{type: categorical, choices: [...]}``.

    Raises:
        SweepError: unreadable file, unknown config key, unknown type or bad bounds (naming the key).
    """
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SweepError(f"--space {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SweepError(f"--space {path}{at}: not YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(tree, dict) or not tree:
        raise SweepError(f"--space {path}: expected a mapping of config keys to distributions")
    keys = set(all_keys()) | {f"model.{k}" for k in model_key_defaults()}  # (every family's model keys)
    for key, spec in tree.items():
        where = f"--space {path}: {key}"
        if key not in keys:
            raise SweepError(f"{where}: not a config key (see `vitflow train --print-config`)")
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise SweepError(f"{where}: needs type: float, int or categorical")
        if unknown := sorted(set(spec) - FIELDS[spec["type"]]):
            raise SweepError(f"{where}: {', '.join(unknown)} is not a field of type {spec['type']} (its fields: "
                             f"{', '.join(sorted(FIELDS[spec['type']] - {'type'}))})")
        if spec["type"] == "categorical":
            if not isinstance(spec.get("choices"), list) or not spec["choices"]:
                raise SweepError(f"{where}: a categorical needs a non-empty list of choices")
            continue
        number = int if spec["type"] == "int" else (int, float)
        if not (all(isinstance(spec.get(k), number) and not isinstance(spec.get(k), bool) for k in ("low", "high"))
                and spec["low"] < spec["high"]) or (spec.get("log") and spec["low"] <= 0):
            raise SweepError(f"{where}: needs {'whole ' if spec['type'] == 'int' else ''}numbers low < high (and "
                             "low > 0 with log: true)")
        if spec.get("log") and spec.get("step") is not None:
            raise SweepError(f"{where}: step and log: true do not go together (Optuna samples either on a grid or "
                             "on a log scale)")
    return tree


def suggest(trial, space: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The trial's values of ``space`` (fixed ones for a trial that runs again)."""
    values = {}
    for key, spec in space.items():
        if spec["type"] == "categorical":
            values[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(key, int(spec["low"]), int(spec["high"]), step=int(spec.get("step", 1)),
                                            log=bool(spec.get("log", False)))
        else:
            values[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), step=spec.get("step"),
                                              log=bool(spec.get("log", False)))
    return values
