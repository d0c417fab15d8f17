"""The table of source kinds (:class:`~vitflow.data.sources.kind.SourceKind`), in detection
order: ``data.source=auto`` takes the first row whose ``detect`` holds. Keys of Python objects
(``python:N:CLASS``) and shard specs (patterns, lists) are recognised before anything else, then
packed datasets, CIFAR batches, Hugging Face datasets and label files, which are folders or files with a mark of their own; an image folder
(any directory) and a tar come last. :mod:`vitflow.data.sources.dispatch` reads the table, and
:func:`check_config` checks ``data.source`` against it.

A new kind is its module (declaring ``KIND = SourceKind(...)``) and one row here.
"""

from __future__ import annotations

import difflib

from vitflow.config import ConfigError, DataConfig
from vitflow.data.sources import cifar, digits, folder, hf, labelfile, packed, pyobjects
from vitflow.data.sources.base import DataError
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.splits import check_splits
from vitflow.data.wds import kind as wds

# the last row is the catch-all: its ``what`` is what a path that no kind detects is said not to be
KINDS: tuple[SourceKind, ...] = (digits.KIND, wds.KIND, packed.KIND, cifar.KIND, hf.KIND, pyobjects.KIND,
                                 labelfile.KIND, folder.FOLDER, folder.TAR)


def kind_named(name: str) -> SourceKind:
    """The row of :data:`KINDS` named ``name``.

    Raises:
        DataError: no such kind (the message lists them and the nearest name).
    """
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise DataError(_unknown(name))


def reads_path(source: str) -> bool:
    """Whether ``data.source=source`` reads ``data.path``: ``False`` only for a kind of built-in
    data (an unknown name is left to :func:`check_config`)."""
    return all(k.needs_path for k in KINDS if k.name == source)


def _unknown(name: str) -> str:
    choices = ["auto", *(k.name for k in KINDS)]
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f"data.source={name!r} is invalid: choose one of {choices}" + (f"; did you mean {close[0]!r}?" if close
                                                                            else "")


def check_config(d: DataConfig) -> None:
    """The data section's checks that need the data layer: ``data.source`` names a kind of
    :data:`KINDS` (or is ``auto``), ``data.path`` is set when the kind named reads one,
    ``data.access=stream`` only where the kind can be read in order, and the split expressions
    (:func:`~vitflow.data.sources.splits.check_splits`).

    Raises:
        ConfigError: naming the key (and for ``data.source`` the kinds and the nearest name).
    """
    if d.source != "auto" and d.source not in {k.name for k in KINDS}:
        raise ConfigError(_unknown(d.source), "data.source")
    kind = None if d.source == "auto" else kind_named(d.source)
    if d.path is None and kind is not None and kind.needs_path:  # auto: told when the data is opened
        raise ConfigError(f"data.path=None is invalid: must be set for data.source={d.source}", "data.path")
    in_order = [k.name for k in KINDS if k.stream_access]
    if d.access != "random" and kind is not None and not kind.stream_access:
        raise ConfigError(f"data.access={d.access!r} is invalid: must be random unless data.source is "
                          f"{' or '.join(in_order)}", "data.access")
    check_splits(d)
