"""Values from YAML or the command line converted to a config field's annotated type (bool, int,
float, str, ``Literal``, unions with ``None``, tuples), each failure one line naming the key."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any, Literal

from vitflow.config.checks import ConfigError


def coerce(value: Any, tp: Any, key: str) -> Any:
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
            return coerce(value, arg, key)
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
    return tuple(coerce(v, a, key) for v, a in zip(value, args))


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
