"""Label files: a CSV / TSV / JSONL table with an image-path column and a label column.

::

    path,label,split                 {"image": "imgs/1.jpg", "labels": ["cat", "dog"]}
    imgs/1.jpg,cat,train             {"image": "imgs/2.jpg", "labels": "dog;bird"}
    imgs/2.jpg,dog,val

Paths are relative to ``data.root`` (default: the label file's folder) or absolute. Splits come
from a split column (``data.split_column``; values such as ``train``, ``val``, ``test``) or, one
file per split, from sibling files named after the splits (``data.path=DIR/train.csv`` with
``DIR/val.csv`` and ``DIR/test.csv`` beside it); a file with neither is the ``train`` split.
The classes are ``data.classes`` (a file, one name per line) or the train split's label values.
Images are taken in path order (as in a folder), whatever the row order. Rows that cannot be used — an empty label cell, a label not in the classes, a duplicated path,
a missing image file, a malformed line — are left out with one warning naming the file and the
line numbers (see :mod:`vitflow.data.sources.labels`).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from vitflow.config import DataConfig
from vitflow.data.remote.fs import basename, exists, is_remote, join, open_stream, parent
from vitflow.data.sources import labels as L
from vitflow.data.sources.base import DataError, FileSource
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.readers import FolderReader

EXTENSIONS = (".csv", ".tsv", ".jsonl")
SPLIT_FILE_NAMES = ("train", "val", "valid", "validation", "test")


def is_label_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in EXTENSIONS


@dataclass(frozen=True)
class Table:
    """A label file's rows: ``columns``, ``rows`` (dicts) and ``lines`` (each row's line number)."""

    path: Path
    columns: tuple[str, ...]
    rows: tuple[dict, ...]
    lines: tuple[int, ...]
    malformed: tuple[tuple[int, str], ...]


@lru_cache(maxsize=16)
def _suffix(path: Path | str) -> str:
    return os.path.splitext(basename(path))[1].lower()


def _stem(path: Path | str) -> str:
    return os.path.splitext(basename(path))[0].lower()


def _read_table(path: Path | str, mtime_ns: int) -> Table:
    """Read (and keep, while unchanged) a label file's rows (a URL through
    :func:`vitflow.data.remote.fs.open_stream`)."""
    del mtime_ns  # part of the cache key only
    try:
        with (io.TextIOWrapper(open_stream(path), encoding="utf-8-sig", newline="") if is_remote(path) else
              open(path, newline="", encoding="utf-8-sig")) as f:
            if _suffix(path) == ".jsonl":
                return _read_jsonl(path, f)
            reader = csv.DictReader(f, delimiter="\t" if _suffix(path) == ".tsv" else ",")
            columns = tuple(reader.fieldnames or ())
            rows, lines, malformed = [], [], []
            for row in reader:
                if None in row:  # more cells than the header
                    malformed.append((reader.line_num, f"{len(columns) + len(row[None])} cells, header has "
                                                       f"{len(columns)}"))
                    continue
                rows.append(row)
                lines.append(reader.line_num)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"label file {path}: cannot read ({e})") from None
    if not columns:
        raise DataError(f"label file {path}: empty (expected a header line naming the columns)")
    return Table(path, columns, tuple(rows), tuple(lines), tuple(malformed))


def _read_jsonl(path: Path, f) -> Table:
    rows, lines, malformed, columns = [], [], [], {}
    for n, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError as e:
            malformed.append((n, f"not JSON ({e.msg})"))
            continue
        if not isinstance(row, dict):
            malformed.append((n, "not a JSON object"))
            continue
        rows.append(row)
        lines.append(n)
        columns.update(dict.fromkeys(row))
    return Table(path, tuple(columns), tuple(rows), tuple(lines), tuple(malformed))


def read_table(path: Path | str) -> Table:
    if is_remote(path):
        return _read_table(str(path), 0)
    return _read_table(path.resolve(), path.stat().st_mtime_ns)


def _split_files(path: Path) -> dict[str, Path]:
    """One file per split: ``DIR/train.csv`` and its siblings named after other splits."""
    if _stem(path) not in SPLIT_FILE_NAMES:
        return {}
    if is_remote(path):  # a store that may not list: ask for each sibling
        candidates = {n: join(parent(path), n + _suffix(path)) for n in SPLIT_FILE_NAMES}
        return {n: url for n, url in candidates.items() if url == str(path) or exists(url)}
    return {f.stem.lower(): f for f in sorted(path.parent.iterdir())
            if f.suffix.lower() == path.suffix.lower() and f.stem.lower() in SPLIT_FILE_NAMES and f.is_file()}


def _split_column(table: Table, requested: str) -> str | None:
    return L.pick_column(table.columns, requested, L.SPLIT_COLUMNS, "data.split_column", str(table.path),
                         required=False)


def label_file_splits(path: Path, split_column: str = "auto") -> list[str]:
    """The split names a label file (or its siblings) holds."""
    files = _split_files(path)
    if files:
        return list(files)
    return table_splits(read_table(path), split_column)


def _rows_of_split(path: Path, split: str, split_column: str) -> tuple[Table, list[int]]:
    """The table holding ``split`` and the positions of its rows.

    Raises:
        DataError: the split is not in the file(s)."""
    files = _split_files(path)
    if files:
        name = L.canonical_split(split, list(files))
        if name is None:
            raise DataError(f"split {split!r} not found beside {path}: expected a file {split}{_suffix(path)} "
                            f"(found: {', '.join(files)})")
        table = read_table(files[name])
        return table, list(range(len(table.rows)))
    table = read_table(path)
    return table, rows_in_split(table, split, split_column)


def table_splits(table: Table, split_column: str = "auto") -> list[str]:
    """The split names of a table's split column (``["train"]`` when it has none)."""
    col = _split_column(table, split_column)
    if col is None:
        return ["train"]
    return sorted({str(r.get(col, "")).strip() for r in table.rows} - {""})


def rows_in_split(table: Table, split: str, split_column: str = "auto") -> list[int]:
    """The positions of ``split``'s rows in ``table``: by its split column, or every row for
    ``train`` when it has none.

    Raises:
        DataError: the split is not in the table."""
    col = _split_column(table, split_column)
    if col is None:
        if split != "train":
            raise DataError(f"split {split!r} not found in {table.path}: it has no split column, so all its rows are "
                            "the 'train' split; add a split column, one file per split (train.csv, val.csv, test.csv), "
                            "or slices such as data.train_split='train[:90%]' data.val_split='train[90%:]'")
        return list(range(len(table.rows)))
    names = table_splits(table, split_column)
    name = L.canonical_split(split, names)
    if name is None:
        raise DataError(f"split {split!r} not found in {table.path} column {col!r} (values: {', '.join(names)})")
    return [i for i, r in enumerate(table.rows) if str(r.get(col, "")).strip() == name]


def _image_base(root: str | None, table_path: Path | str) -> Path | str:
    """Where relative image paths start: ``data.root`` or the label file's folder (a URL for a
    remote label file; its images are read from the store and not checked beforehand)."""
    if root:
        return root if is_remote(root) else Path(root).expanduser()
    return parent(table_path) if is_remote(table_path) else Path(table_path).parent


def open_label_file_split(path: Path, split: str, classes: list[str] | None = None, root: str | None = None,
                          image_column: str = "auto", label_column: str = "auto", split_column: str = "auto",
                          multilabel: bool = False, separator: str = ";", class_file: str | None = None) -> FileSource:
    """The images of ``split`` listed in the label file ``path``, in file order, with their labels
    (``int64 (n,)`` class indices, or ``uint8 (n, C)`` multi-hot rows when ``multilabel``).

    Args:
        classes: the class list to label with (the train split's, for val / test); ``None``:
            ``class_file`` or the label values of this split.
        root: the folder relative image paths start from (default: the label file's folder).
    Raises:
        DataError: unreadable file, no path / label column, unknown split, or no usable row.
    """
    table, positions = _rows_of_split(path, split, split_column)
    return table_source(table, positions, split, classes, _image_base(root, table.path), image_column, label_column,
                        split_column, multilabel, separator, class_file)


def table_source(table: Table, positions: list[int], split: str, classes: list[str] | None, base: Path | str,
                 image_column: str = "auto", label_column: str = "auto", split_column: str = "auto",
                 multilabel: bool = False, separator: str = ";", class_file: str | None = None) -> FileSource:
    """The images of the rows ``positions`` of ``table`` (the rows of ``split``), read from ``base``
    (relative paths start there), in path order, labelled as :func:`open_label_file_split` says.

    Raises:
        DataError: no path / label column, or no usable row.
    """
    where = str(table.path)
    img_col = L.pick_column(table.columns, image_column, L.IMAGE_COLUMNS, "data.image_column", where)
    lab_col = L.pick_column(table.columns, label_column, L.LABEL_COLUMNS, "data.label_column", where)
    malformed = table.malformed if split == "train" or not _split_column(table, split_column) else ()
    dropped: list[tuple[str, str]] = [(f"{basename(table.path)} line {n}", why) for n, why in malformed]
    cells, rels, lines, seen = [], [], [], {}
    for i in sorted(positions, key=lambda i: str(table.rows[i].get(img_col) or "")):  # path order, as folders
        row, line = table.rows[i], table.lines[i]
        rel = str(row.get(img_col) or "").strip()
        here = f"{basename(table.path)} line {line}"
        if not rel:
            dropped.append((here, "empty image path"))
        elif rel in seen:
            dropped.append((here, f"{rel} already listed on line {seen[rel]}"))
        elif not is_remote(base) and not is_remote(rel) and not (base / rel).is_file():
            dropped.append((here, f"no image file {base / rel}"))
        else:
            seen[rel] = line
            cells.append(L.split_cell(row.get(lab_col), multilabel, separator))
            rels.append(rel)
            lines.append(here)
    if classes is None:
        classes = L.classes_from(cells, class_file)
    encoded = L.encode_rows(cells, classes, multilabel, lines)
    dropped += encoded.dropped
    L.warn_dropped(f"{where} split {split!r}", dropped, len(positions) + len(malformed))
    if len(encoded.keep) == 0:
        raise DataError(f"{where} split {split!r}: no usable rows ({len(dropped)} left out; see the warning above)")
    keys = np.array([os.fsencode(rels[i]) for i in encoded.keep])
    return FileSource(list(classes), encoded.labels, FolderReader(base), keys)


def _open(where: Path, split: str, classes: list[str] | None, cfg: DataConfig) -> FileSource:
    return open_label_file_split(where, split, classes, cfg.root, cfg.image_column, cfg.label_column, cfg.split_column,
                                 cfg.task == "multilabel", cfg.label_separator, cfg.classes)


KIND = SourceKind("labels", "a label file (.csv, .tsv or .jsonl) of image paths and labels",
                  lambda where, cfg: label_file_splits(where, cfg.split_column), _open, detect=is_label_file,
                  what="label file (.csv, .tsv or .jsonl)", remote=lambda url: _suffix(url) in EXTENSIONS,
                  table_labels=True)
