"""Hugging Face datasets: a ``save_to_disk`` folder or Parquet files, read straight from Arrow.

Layouts (``data.path``)::

    ROOT/dataset_dict.json + ROOT/<split>/...      a DatasetDict saved with save_to_disk
    ROOT/state.json + ROOT/data-*.arrow            a single Dataset saved with save_to_disk: "train"
    FILE.parquet                                   one Parquet file: "train"
    ROOT/**/*.parquet                              Parquet files, split names from their names as the
                                                   Hub lays them out: data/train-00000-of-00002.parquet,
                                                   test-00000-of-00001.parquet, validation.parquet,
                                                   train/0000.parquet (see :func:`hf_split_names`)

The image column holds the ``datasets.Image`` feature's struct ``{bytes, path}``, plain binary
bytes, or a string path (absolute, or relative to ROOT / the Parquet file's folder). Its bytes are
never decoded by ``datasets``: they are sliced out of the Arrow buffers (memory-mapped for
``save_to_disk`` folders) through per-chunk NumPy views of the offsets, and decoded by
:func:`vitflow.data.decode.decode_image`, so the RAM cache, the packed format and forked workers
apply as for image folders.

The label column is a ``ClassLabel`` (its names are the classes), a ``Sequence(ClassLabel)`` or a
list of strings (multi-label), or plain strings / integers (classes from the values, see
:mod:`vitflow.data.sources.labels`). ``pyarrow`` and ``datasets`` are optional: ``pip install 'vitflow[hf]'``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.sources import labels as lb
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.hflayout import hf_split_names, is_hf_dataset, locate_split
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.readers import display_name

log = logging.getLogger(__name__)

INSTALL_HINT = "reading Hugging Face datasets needs pip install 'vitflow[hf]'"


def _pyarrow():
    """``(pyarrow, pyarrow.parquet)``. Raises DataError when pyarrow is not installed."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(INSTALL_HINT) from None
    return pyarrow, pyarrow.parquet


def _features_of(schema) -> dict:
    """The ``datasets`` features (JSON form: name -> ``{"_type": ...}``) stored in an Arrow schema's
    ``huggingface`` metadata, ``{}`` when absent or unreadable."""
    try:
        return json.loads(schema.metadata[b"huggingface"])["info"]["features"] or {}
    except (TypeError, KeyError, ValueError):
        return {}


def _read_saved(p: Path, split: str, kind: str) -> tuple:
    """``(table, features, where)`` of one split of a ``save_to_disk`` folder, memory-mapped."""
    try:
        import datasets
    except ImportError:
        raise DataError(INSTALL_HINT) from None
    folder = p / split if kind == "dict" else p
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # whatever the reader fails with, the data is unreadable
        raise DataError(f"{folder}: cannot read the saved dataset ({type(e).__name__}: {e})") from None
    if ds._indices is not None:  # not written by save_to_disk (it flattens), but kept correct
        ds = ds.flatten_indices()
    return ds.data.table, ds.features.to_dict(), str(folder)


def _read_parquet(files: list[Path], where: str, image_column: str, label_column: str) -> tuple:
    """``(table, features, image column, label column)`` of the Parquet ``files`` of one split,
    reading only the two columns (memory-mapped files).

    Raises:
        DataError: an unreadable file, files with different columns, or the image / label column
            not found (see :func:`_pick_columns`).
    """
    pa, pq = _pyarrow()
    try:
        schema = pq.read_schema(files[0], memory_map=True)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{files[0]}: not a readable Parquet file ({e})") from None
    features = _features_of(schema)
    image, label = _pick_columns(schema, features, image_column, label_column, where)
    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f, columns=[image, label], memory_map=True))
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{f}: not a readable Parquet file, or without the columns {image!r} and {label!r} "
                            f"({e})") from None
    try:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    except pa.ArrowException as e:
        raise DataError(f"{where}: the Parquet files' columns differ ({e})") from None
    return table, features, image, label


def _feature_type(feature: dict | None) -> str | None:
    return feature.get("_type") if isinstance(feature, dict) else None


def _class_names(feature: dict | None) -> list[str] | None:
    """The names of a ``ClassLabel`` or of a list of ``ClassLabel`` feature, else ``None``."""
    if _feature_type(feature) in ("Sequence", "List", "LargeList"):
        feature = feature.get("feature")
    if _feature_type(feature) == "ClassLabel" and feature.get("names"):
        return [str(n) for n in feature["names"]]
    return None


def _pick_columns(schema, features: dict, image_column: str, label_column: str, where: str) -> tuple[str, str]:
    """The image and label columns: the requested ones, else (``auto``) the first ``Image`` feature
    or one of :data:`~vitflow.data.sources.labels.IMAGE_COLUMNS` or the only binary column; a label
    column named as in :data:`~vitflow.data.sources.labels.LABEL_COLUMNS`, else the first ``ClassLabel``.

    Raises:
        DataError: a requested column missing, or none found; names ``where`` and the columns.
    """
    pa, _ = _pyarrow()
    columns = list(schema.names)
    image = None
    if image_column == "auto":
        image = next((c for c in columns if _feature_type(features.get(c)) == "Image"), None)
        image = image or lb.pick_column(columns, "auto", lb.IMAGE_COLUMNS, "data.image_column", where, required=False)
        binary = [f.name for f in schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        image = image or (binary[0] if len(binary) == 1 else None)
    image = image or lb.pick_column(columns, image_column, lb.IMAGE_COLUMNS, "data.image_column", where)
    rest = [c for c in columns if c != image]
    label = None
    if label_column == "auto":
        label = lb.pick_column(rest, "auto", lb.LABEL_COLUMNS, "data.label_column", where, required=False)
        typed = [c for c in rest if _class_names(features.get(c))]
        if label is None and typed:
            label = typed[0]
            if len(typed) > 1:
                log.info("%s: labelling with column %r (other ClassLabel columns: %s; choose with "
                         "data.label_column=COLUMN)", where, label, ", ".join(typed[1:]))
    label = label or lb.pick_column(rest, label_column, lb.LABEL_COLUMNS, "data.label_column", where)
    return image, label


class _Blobs:
    """Row -> bytes of a binary or string Arrow column, without copying the column: per-chunk
    NumPy views of Arrow's offsets (``int32`` / ``int64`` ``(len + 1,)``) and data (``uint8``)
    buffers, and the chunks' first rows (``int64`` ``(k,)``) to find a row's chunk."""

    def __init__(self, chunks: list):
        pa, _ = _pyarrow()
        self._chunks = [c for c in chunks if len(c)]  # keeps the (memory-mapped) buffers alive
        self.starts = np.zeros(len(self._chunks), dtype=np.int64)
        self.offsets: list[np.ndarray] = []
        self.data: list[np.ndarray] = []
        row = 0
        for k, c in enumerate(self._chunks):
            if pa.types.is_binary_view(c.type) or pa.types.is_string_view(c.type):
                c = self._chunks[k] = c.cast(pa.large_binary())
            large = pa.types.is_large_binary(c.type) or pa.types.is_large_string(c.type)
            _, offsets, data = c.buffers()[:3]
            self.starts[k], row = row, row + len(c)
            self.offsets.append(np.frombuffer(offsets, np.int64 if large else np.int32)[c.offset:c.offset + len(c) + 1])
            self.data.append(np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8))

    def get(self, row: int) -> bytes:
        """The bytes of ``row`` (a valid, non-null row of the column)."""
        k = 0 if len(self.starts) == 1 else int(np.searchsorted(self.starts, row, side="right")) - 1
        j = row - int(self.starts[k])
        off = self.offsets[k]
        return self.data[k][off[j]:off[j + 1]].tobytes()


def _valid(chunks: list) -> np.ndarray:
    """``bool`` ``(n,)``: the rows of a column that are not null."""
    parts = [c.is_valid().to_numpy(zero_copy_only=False) for c in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _image_column(column, name: str, where: str) -> tuple[_Blobs | None, _Blobs | None, np.ndarray, np.ndarray]:
    """``(bytes, paths, has_bytes, has_path)`` of an image column: an ``Image`` struct
    ``{bytes, path}``, binary bytes or string paths; ``has_*`` are ``bool`` ``(n,)``.

    Raises:
        DataError: the column holds anything else (names ``where``, the column and its type).
    """
    pa, _ = _pyarrow()
    t = column.type
    none = np.zeros(len(column), dtype=bool)
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        flat = [c.flatten() for c in column.chunks]
        bi, pi = t.get_field_index("bytes"), t.get_field_index("path")
        data = [f[bi] for f in flat]
        paths = [f[pi] for f in flat] if pi >= 0 else None
        return (_Blobs(data), _Blobs(paths) if paths else None, _valid(data),
                _valid(paths) if paths else none)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return _Blobs(column.chunks), None, _valid(column.chunks), none
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return None, _Blobs(column.chunks), none, _valid(column.chunks)
    raise DataError(f"{where}: image column {name!r} holds {t}, not encoded images (bytes or an Image feature) "
                    "or image paths: name another with data.image_column=COLUMN")


def _label_cells(column, label: str, names: list[str] | None, multilabel: bool, separator: str,
                 where: str) -> list[list[str]]:
    """Each row's label names: a ``ClassLabel`` index (``-1``: no label) or list of them through
    ``names``; any other cell through :func:`~vitflow.data.sources.labels.split_cell`.

    Raises:
        DataError: the column holds neither names, numbers nor lists of them.
    """
    pa, _ = _pyarrow()
    t = column.type
    item = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t
    if not (pa.types.is_integer(item) or pa.types.is_string(item) or pa.types.is_large_string(item)
            or pa.types.is_boolean(item) or pa.types.is_floating(item) or pa.types.is_dictionary(item)):
        raise DataError(f"{where}: label column {label!r} holds {t}, "
                        "not class names or indices: name another with data.label_column=COLUMN")
    values = column.to_pylist()
    if names is None:
        return [lb.split_cell(v, multilabel, separator) for v in values]
    single = [[n] for n in names]

    def name(v: int) -> str:
        return names[v] if 0 <= v < len(names) else str(v)

    cells: list[list[str]] = []
    for v in values:
        if isinstance(v, list):
            cells.append([name(x) for x in v if x is not None and x >= 0])
        else:
            cells.append([] if v is None or v < 0 else single[v] if v < len(names) else [str(v)])
    return cells


class _Where:
    """``where[i]``: how messages name row ``i`` of a split (built only for the rows named)."""

    def __init__(self, prefix: str, n: int):
        self.prefix, self.n = prefix, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        return f"{self.prefix}[{i}]"


class HFSource(ImageSource):
    """Rows of one split of a Hugging Face dataset. ``rows`` (``int64`` ``(n,)``) are the rows of
    the split's table; ``images`` / ``paths`` give a row's encoded bytes or its file path, and
    ``has_bytes`` / ``has_path`` (``bool`` over the table's rows) which a row has: the bytes are
    used when there, else the file is read (relative paths from ``root``). ``prefix`` names the
    split (``<path>[train]``). Nothing holds an open file: memory maps and NumPy views only, so
    forked workers share the source."""

    def __init__(self, classes: list[str], labels: np.ndarray, rows: np.ndarray, images: _Blobs | None,
                 paths: _Blobs | None, has_bytes: np.ndarray, has_path: np.ndarray, root: Path, prefix: str):
        self.classes, self.labels, self.rows, self.images, self.paths = classes, labels, rows, images, paths
        self.has_bytes, self.has_path, self.root, self.prefix = has_bytes, has_path, root, prefix

    def _path(self, row: int) -> str:
        return os.fsdecode(self.paths.get(row)) if self.has_path[row] else ""

    def name(self, i: int) -> str:
        """``<path>[split][row]``, with the image's own path when the row has one."""
        row = int(self.rows[i])
        path = self._path(row)
        return f"{self.prefix}[{row}] ({display_name(path)})" if path else f"{self.prefix}[{row}]"

    def encoded(self, i: int) -> bytes:
        """The image's encoded bytes (from the Arrow data, or its file). Raises CorruptImageError
        when the file cannot be read."""
        row = int(self.rows[i])
        if self.has_bytes[row]:
            return self.images.get(row)
        try:
            with open(self.root / self._path(row), "rb") as f:  # an absolute path replaces root
                return f.read()
        except OSError as e:
            raise CorruptImageError(self.name(i), f"cannot read: {e.strerror or e}") from None

    def load(self, i: int) -> torch.Tensor:
        return decode_image(self.encoded(i), self.name(i))

    def subset(self, idx: np.ndarray) -> "HFSource":
        return HFSource(self.classes, self.labels[idx], self.rows[idx], self.images, self.paths, self.has_bytes,
                        self.has_path, self.root, self.prefix)


def _missing_images(paths: _Blobs | None, has_bytes: np.ndarray, has_path: np.ndarray, root: Path) -> np.ndarray:
    """``bool`` ``(n,)``: rows with neither bytes nor a path to an existing file."""
    missing = ~has_bytes & ~has_path
    for row in np.flatnonzero(~has_bytes & has_path):
        rel = os.fsdecode(paths.get(int(row)))
        missing[row] = not rel or not os.path.isfile(root / rel)
    return missing


def _open_table(p: Path, split: str, image_column: str, label_column: str) -> tuple:
    """``(table, features, image column, label column, where, split)`` for one split."""
    found, kind, files = locate_split(p, split)
    if kind:
        table, features, where = _read_saved(p, found, kind)
        image, label = _pick_columns(table.schema, features, image_column, label_column, where)
        return table, features, image, label, where, found
    where = str(files[0]) if len(files) == 1 else f"{p} split {found!r} ({len(files)} Parquet files)"
    return (*_read_parquet(files, where, image_column, label_column), where, found)


def open_hf_split(path: str | Path, split: str, classes: list[str] | None = None, image_column: str = "auto",
                  label_column: str = "auto", multilabel: bool = False, separator: str = ";",
                  class_file: str | None = None) -> HFSource:
    """The rows of split ``split`` of a Hugging Face dataset (``save_to_disk`` folder or Parquet
    files, see the module docstring); ``val`` also finds ``valid`` / ``validation``.

    Args:
        classes: the class list to label with (the train split's, for val/test); ``None``: the
            ``class_file`` (``data.classes``), else the label column's ``ClassLabel`` names, else the
            sorted label values of this split.
        image_column, label_column: column names, or ``auto`` (see :func:`_pick_columns`).
        multilabel: labels are ``uint8`` ``(n, C)`` multi-hot rows instead of ``int64`` ``(n,)``.
        separator: between several labels in one string cell (multi-label).
    Returns:
        An :class:`HFSource`, rows in table order. Rows with an empty or unknown label or a missing
        image are left out with one warning naming the rows (``<path>[train][17]``).
    Raises:
        DataError: pyarrow / datasets missing, the split missing, an unreadable file, no image or
            label column, an empty split, or no usable rows.
    """
    p = Path(path).expanduser()
    table, features, image, label, where, split = _open_table(p, split, image_column, label_column)
    n = table.num_rows
    if n == 0:
        raise DataError(f"{where}: split {split!r} is empty")
    images, paths, has_bytes, has_path = _image_column(table.column(image), image, where)
    names = _class_names(features.get(label))
    cells = _label_cells(table.column(label), label, names, multilabel, separator, where)
    root = p if p.is_dir() else p.parent
    missing = _missing_images(paths, has_bytes, has_path, root)
    if classes is None:
        usable = [c for c, gone in zip(cells, missing) if not gone]  # a class only rows without images have is none
        if not class_file and names is None and not any(usable):
            raise DataError(f"{where}: no labels in column {label!r} of split {split!r}")
        classes = lb.read_class_file(class_file) if class_file else names or lb.classes_from(usable, None)
    prefix = f"{p}[{split}]"
    rows = lb.encode_rows(cells, list(classes), multilabel, _Where(prefix, n))
    ok = ~missing[rows.keep]
    why = {int(r): ("no image" if not has_path[r] else "image file not found") for r in np.flatnonzero(missing)}
    gone = np.setdiff1d(np.arange(n), rows.keep)  # the rows encode_rows left out, in its order
    reasons = {int(r): d for r, d in zip(gone, rows.dropped)} | {r: (f"{prefix}[{r}]", w) for r, w in why.items()}
    dropped = [reasons[r] for r in sorted(reasons)]
    lb.warn_dropped(f"{where} split {split!r}", dropped, n)
    if not ok.any():
        raise DataError(f"{where}: no usable rows in split {split!r} (of {n}; e.g. {dropped[0][0]}: {dropped[0][1]})")
    return HFSource(list(classes), rows.labels[ok], rows.keep[ok], images, paths, has_bytes, has_path,
                    root, prefix)


def _open(where: Path, split: str, classes: list[str] | None, cfg: DataConfig) -> HFSource:
    return open_hf_split(where, split, classes, cfg.image_column, cfg.label_column, cfg.task == "multilabel",
                         cfg.label_separator, cfg.classes)


KIND = SourceKind("hf", "a Hugging Face dataset (save_to_disk folder or Parquet files)",
                  lambda where, cfg: hf_split_names(where), _open, detect=is_hf_dataset,
                  what="Hugging Face dataset (save_to_disk folder or Parquet files)", table_labels=True)
