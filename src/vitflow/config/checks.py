"""The configuration's error type and the one-line check every section's ``validate()`` uses."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key. ``key`` (e.g.
    ``"train.lr"``, or ``None`` when no single key is at fault) lets ``build_config`` say which
    layer (preset, config file, command line) set a value that fails validation."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def check(ok: bool, key: str, value: Any, requirement: str) -> None:
    """Raise :class:`ConfigError` (``KEY=VALUE is invalid: must be REQUIREMENT``) unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {requirement}", key)
