"""Labels given as values in a table (label files, Hugging Face datasets): picking the image,
label and split columns, splitting multi-label cells, the class list, and turning rows into a
split's label array.

Label arrays: ``int64 (n,)`` class indices for ``data.task=multiclass``; ``uint8 (n, C)``
multi-hot rows for ``multilabel``. A row that cannot be used (an empty label cell, a label not
in the class list, a duplicated image) is left out with a warning naming the file and line, as
an unreadable image is skipped: the run goes on, and the warning says how many rows were left
out.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from vitflow.data.remote.fs import is_remote, read_bytes
from vitflow.data.sources.base import DataError

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "path", "file", "filename", "file_name", "filepath", "file_path", "image_path", "img")
LABEL_COLUMNS = ("label", "labels", "class", "category", "target", "tags")
SPLIT_COLUMNS = ("split", "subset", "fold")
VAL_NAMES = ("val", "valid", "validation")  # what data.val_split=auto looks for, in this order
TEST_NAMES = ("test",)


def pick_column(columns: Sequence[str], requested: str, candidates: Sequence[str], key: str, where: str,
                required: bool = True) -> str | None:
    """The column to read: ``requested`` when it is not ``"auto"`` (it must exist), else the first
    of ``candidates`` present (case-insensitive).

    Raises:
        DataError: the requested column is missing, or (``required``) none of the candidates is
            there; the message names ``where``, ``key`` and the columns found.
    """
    if requested != "auto":
        if requested in columns:
            return requested
        raise DataError(f"{where}: no column {requested!r} ({key}); columns: {', '.join(map(str, columns))}")
    lower = {str(c).lower(): c for c in columns}
    for name in candidates:
        if name in lower:
            return lower[name]
    if not required:
        return None
    raise DataError(f"{where}: no {key.split('.')[-1].replace('_', ' ')} among the columns "
                    f"({', '.join(map(str, columns))}): name one with {key}=COLUMN (looked for {', '.join(candidates)})")


def read_class_file(path: str | Path) -> list[str]:
    """Class names from a text file (local or a URL), one per line (blank lines and ``#`` comments
    ignored).

    Raises:
        DataError: the file is missing, empty, or names a class twice (RemoteError for a URL that
        cannot be read).
    """
    p = str(path) if is_remote(path) else Path(path).expanduser()
    try:
        lines = (read_bytes(p).decode("utf-8") if is_remote(p) else p.read_text(encoding="utf-8")).splitlines()
    except OSError as e:
        raise DataError(f"data.classes {p}: cannot read ({e.strerror or e})") from None
    names = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    if not names:
        raise DataError(f"data.classes {p}: no class names (expected one per line)")
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            raise DataError(f"data.classes {p}: class {n!r} listed twice")
        seen.add(n)
    return names


def split_cell(value: object, multilabel: bool, separator: str) -> list[str]:
    """The label names in one cell: ``"cat"``; for multi-label also ``"cat;dog"`` (``separator``),
    a JSON list ``'["cat", "dog"]'`` or a list. Numbers become their text (``3`` -> ``"3"``).
    An empty or missing cell gives ``[]``."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return []
    if isinstance(value, (list, tuple, np.ndarray)):
        return [str(v).strip() for v in value if str(v).strip()]
    text = str(value).strip()
    if not multilabel:
        return [text] if text else []
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        if isinstance(items, list):
            return [str(v).strip() for v in items if str(v).strip()]
    return [t.strip() for t in text.split(separator) if t.strip()]


def sorted_classes(names: set[str]) -> list[str]:
    """Class names in index order: numerically when every name is an integer (``"2"`` before
    ``"10"``), else sorted as text (as class folders are)."""
    if names and all(n.lstrip("-").isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


@dataclass
class Rows:
    """The usable rows of one split: ``keep`` (row positions into the table), their ``labels`` and
    the rows left out as ``(where, why)``."""

    keep: np.ndarray
    labels: np.ndarray
    dropped: list[tuple[str, str]] = field(default_factory=list)


def encode_rows(cells: Sequence[list[str]], classes: list[str], multilabel: bool,
                where: Sequence[str]) -> Rows:
    """Turn each row's label names (``cells[i]``, from :func:`split_cell`) into the split's label
    array (see the module docstring), leaving out rows with no label, a label not in ``classes``
    or (multi-class) more than one label. ``where[i]`` names row ``i`` in messages
    (``labels.csv line 7``)."""
    index = {c: i for i, c in enumerate(classes)}
    keep: list[int] = []
    rows: list = []
    dropped: list[tuple[str, str]] = []
    for i, names in enumerate(cells):
        unknown = [n for n in names if n not in index]
        if not names:
            dropped.append((where[i], "empty label"))
        elif unknown:
            dropped.append((where[i], f"unknown label {unknown[0]!r}" + ("" if len(classes) > 20 else
                                                                          f" (classes: {', '.join(classes)})")))
        elif not multilabel and len(names) > 1:
            dropped.append((where[i], f"{len(names)} labels in a multiclass task (set data.task=multilabel)"))
        else:
            keep.append(i)
            rows.append([index[n] for n in names])
    if multilabel:
        labels = np.zeros((len(keep), len(classes)), dtype=np.uint8)
        for r, idx in enumerate(rows):
            labels[r, idx] = 1
    else:
        labels = np.array([r[0] for r in rows], dtype=np.int64)
    return Rows(np.array(keep, dtype=np.int64), labels, dropped)


def classes_from(cells_per_split: Sequence[list[str]], class_file: str | None) -> list[str]:
    """The class list: ``data.classes`` when given, else every label name found in the train
    split's cells (see :func:`sorted_classes`).

    Raises:
        DataError: no label at all.
    """
    if class_file:
        return read_class_file(class_file)
    names = {n for cell in cells_per_split for n in cell}
    if not names:
        raise DataError("no labels found in the train split")
    return sorted_classes(names)


_WARNED: set[tuple] = set()


def warn_dropped(what: str, dropped: list[tuple[str, str]], total: int) -> None:
    """One warning for the rows of ``what`` left out: how many, and the first three with why; once
    per process, however many slices of the split are opened (``train[:90%]`` and ``train[90%:]``
    warn once)."""
    key = (what, len(dropped), dropped[0] if dropped else None, total)
    if not dropped or key in _WARNED:
        return
    _WARNED.add(key)
    shown = "; ".join(f"{w}: {why}" for w, why in dropped[:3])
    log.warning("%s: left out %d of %d rows (%s%s)", what, len(dropped), total, shown,
                "; ..." if len(dropped) > 3 else "")


def canonical_split(name: str, available: Sequence[str]) -> str | None:
    """The split among ``available`` that ``name`` asks for: itself, or for ``val`` any of
    :data:`VAL_NAMES` (``valid``, ``validation``)."""
    if name in available:
        return name
    if name in VAL_NAMES:
        return next((v for v in VAL_NAMES if v in available), None)
    return None
