"""Named evaluation splits (big_vision's ``evals``): ``data.evals=name:split,name2:split2``, each
split evaluated at every evaluation of a run and logged under its own name (``name_top1``, ...).

A split is a split expression of the run's data (``train[90%:]``, ``test[:500]``, ``val``), opened
with the training classes (:func:`vitflow.data.sources.dispatch.open_split`).
"""

from __future__ import annotations

import re

from vitflow.config import ConfigError, DataConfig
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.dispatch import open_split
from vitflow.data.sources.splits import parse_split

RESERVED = ("train", "val", "test", "ema", "raw")  # prefixes the run's own figures use
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]*")


def parse_evals(spec: str | None) -> dict[str, str]:
    """``"name:split,name2:split2"`` -> ``{"name": "split", "name2": "split2"}`` (in order).

    Raises:
        ConfigError: an entry without ``name:``, a bad or reserved name (train, val, test, ema,
            raw), a name given twice, or a split expression that does not parse (naming
            ``data.evals`` and the entry).
    """
    if not spec or not str(spec).strip():
        return {}
    out: dict[str, str] = {}
    for entry in re.split(r",\s*(?=[A-Za-z][A-Za-z0-9_\-]*\s*:)", str(spec).strip()):
        name, sep, split = entry.partition(":")
        name, split = name.strip(), split.strip()
        if not sep or not _NAME.fullmatch(name) or not split:
            raise ConfigError(f"data.evals: {entry!r} is not of the form name:split (e.g. "
                              "data.evals=minival:train[98%:],v2:test)", "data.evals")
        if name in RESERVED:
            raise ConfigError(f"data.evals: the name {name!r} is reserved ({', '.join(RESERVED)}); choose another",
                              "data.evals")
        if name in out:
            raise ConfigError(f"data.evals: the name {name!r} is given twice", "data.evals")
        try:
            parse_split(split)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"data.evals: {name}:{split}: {e}", "data.evals") from None
        out[name] = split
    return out


def open_evals(cfg: DataConfig, classes: list[str]) -> dict[str, tuple[str, ImageSource]]:
    """The named splits of ``cfg.evals`` opened with ``classes``: ``{name: (split, source)}``.

    Raises:
        ConfigError: see :func:`parse_evals`. DataError: a split that cannot be opened or selects
            no images (naming ``data.evals`` and the entry).
    """
    out = {}
    for name, split in parse_evals(cfg.evals).items():
        try:
            source = open_split(cfg.path, split, cfg.source, classes=classes, cfg=cfg)
        except DataError as e:
            raise DataError(f"data.evals {name}:{split}: {e}") from None
        if len(source) == 0:
            raise DataError(f"data.evals {name}:{split} selects no images")
        out[name] = (split, source)
    return out
