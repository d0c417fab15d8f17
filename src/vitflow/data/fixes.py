"""Fixes to a dataset that leave its files alone: ``data.exclude=FILE`` drops images and
``data.relabel=FILE`` gives images another class, in every split (train, validation, test and
named evaluations), as ``vitflow inspect`` proposes them (:mod:`vitflow.quality`).

An image is named in a fix file by its **key**, :func:`image_key`: its path relative to the data's
root for a folder (``train/ants/0013035.jpg``), its member name for a tar
(``hymenoptera/train/ants/0013035.jpg``), else its display name (``source.name(i)``); the full
display name (``/data/photos/train/ants/0013035.jpg``, ``photos.tar:...``) is accepted too.

- ``data.exclude``: a text file, one key per line; blank lines and lines starting with ``#`` are
  skipped.
- ``data.relabel``: a CSV file with a header holding the columns ``path`` (a key) and ``label``
  (a class name of the data); other columns (``given``, ``score``, ...) are ignored.

An image listed in both is relabelled, not dropped, so ``data.relabel=R data.exclude=E`` relabels
what ``R`` lists and drops the rest of ``E``. The user's files are only read.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vitflow.data.sources.base import DataError, FileSource, ImageSource

log = logging.getLogger(__name__)
_SAID: set[tuple] = set()  # (files, split, size) already logged: a split opened again says it at debug level


def image_key(source: ImageSource, i: int) -> str:
    """The name of image ``i`` of ``source`` in a fix file (see the module docstring)."""
    files = getattr(source, "base", None)
    if isinstance(files, FileSource) and hasattr(source, "ids"):  # a RAM cache of files
        source, i = files, int(source.ids[i])
    if isinstance(source, FileSource):
        return os.fsdecode(source.keys[i])
    return source.name(i)


@dataclass(frozen=True)
class Fixes:
    """The fixes of one run: ``exclude`` keys, ``relabel`` key -> class name, and the files they came
    from (for messages and the run's record)."""

    exclude: frozenset[str] = frozenset()
    relabel: dict[str, str] = field(default_factory=dict)
    exclude_file: str | None = None
    relabel_file: str | None = None

    def __bool__(self) -> bool:
        return bool(self.exclude or self.relabel)


def read_exclude(path: str | Path) -> frozenset[str]:
    """The keys of an exclude file. Raises DataError: the file cannot be read (named)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        raise DataError(f"data.exclude: cannot read {path}: {e.strerror or e}") from None
    return frozenset(s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#"))


def read_relabel(path: str | Path) -> dict[str, str]:
    """``key -> class name`` of a relabel CSV. Raises DataError: unreadable, or no ``path`` and
    ``label`` columns, or a row without a label (named with its line)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise DataError(f"data.relabel: cannot read {path}: {e.strerror or e}") from None
    if rows and not {"path", "label"} <= set(rows[0]):
        raise DataError(f"data.relabel: {path} needs a header with the columns path and label "
                        f"(found: {', '.join(k for k in rows[0] if k)})")
    out = {}
    for line, row in enumerate(rows, start=2):
        key, label = (row.get("path") or "").strip(), (row.get("label") or "").strip()
        if not key or not label:
            raise DataError(f"data.relabel: {path} line {line}: a path and a label are needed, got {row}")
        out[key] = label
    return out


def read_fixes(exclude: str | None, relabel: str | None) -> Fixes:
    """The fixes named by ``data.exclude`` / ``data.relabel`` (``None``: none). Raises DataError."""
    return Fixes(read_exclude(exclude) if exclude else frozenset(), read_relabel(relabel) if relabel else {},
                 exclude, relabel)


def apply_fixes(source: ImageSource, fixes: Fixes, split: str) -> ImageSource:
    """``source`` without the excluded images and with the relabelled ones' new labels (a new source;
    ``source`` is unchanged). Logs what it changed in ``split``.

    Raises:
        DataError: a relabel to a class the data does not have (named with the image), or a split
            left with no image.
    """
    if not fixes or len(source) == 0:
        return source
    keys = [(image_key(source, i), source.name(i)) for i in range(len(source))]
    new_label = {i: fixes.relabel.get(k, fixes.relabel.get(n)) for i, (k, n) in enumerate(keys)}
    new_label = {i: c for i, c in new_label.items() if c is not None}
    drop = np.array([i not in new_label and (k in fixes.exclude or n in fixes.exclude)
                     for i, (k, n) in enumerate(keys)], dtype=bool)
    if drop.all():
        raise DataError(f"data.exclude={fixes.exclude_file} excludes every image of split {split!r}")
    kept = np.flatnonzero(~drop)
    out = source.subset(kept)  # a new source even when nothing is dropped: relabelling must not touch ``source``
    if new_label:
        if np.asarray(source.labels).ndim != 1:
            raise DataError("data.relabel gives one class per image; this data is data.task=multilabel")
        index = {c: j for j, c in enumerate(source.classes)}
        labels = np.array(out.labels, copy=True)
        position = {int(i): p for p, i in enumerate(kept)}
        for i, c in new_label.items():
            if c not in index:
                raise DataError(f"data.relabel={fixes.relabel_file}: {keys[i][0]} -> {c!r} is not a class of the data "
                                f"({', '.join(source.classes[:10])}{' ...' if len(source.classes) > 10 else ''})")
            labels[position[i]] = index[c]
        out.labels = labels
    changed = int((np.asarray(out.labels) != np.asarray(source.labels)[kept]).sum()) if new_label else 0
    if not new_label and not drop.any() and split.split("[", 1)[0] == "train":  # likely keys of another root
        files = " and ".join(f"data.{k}={v}" for k, v in (("exclude", fixes.exclude_file),
                                                              ("relabel", fixes.relabel_file)) if v)
        log.warning("%s: none of its %d image key(s) is in split %r (its keys look like %r; a key is the path "
                    "relative to data.path, a tar's member name or the full path), so nothing is fixed there",
                    files, len(fixes.exclude | set(fixes.relabel)), split, keys[0][0])
    said = (fixes.exclude_file, fixes.relabel_file, split, len(source))
    (log.debug if said in _SAID else log.info)(
        "split %r: %d image(s) excluded (data.exclude), %d relabelled (data.relabel; %d to another class)",
        split, int(drop.sum()), len(new_label), changed)
    _SAID.add(said)
    return out

