"""Where the splits of a Hugging Face dataset are: a ``save_to_disk`` folder (``DatasetDict`` or a
single ``Dataset``), one Parquet file, or Parquet files named as the Hub lays them out
(``data/train-00000-of-00002.parquet``, ``validation.parquet``, ``train/0000.parquet``).
:mod:`vitflow.data.sources.hf` reads the rows."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath

from vitflow.data.decode import is_image_name
from vitflow.data.sources import labels as lb
from vitflow.data.sources.base import DataError
from vitflow.data.sources.readers import is_hidden

# split keywords as `datasets` resolves data files: name as written -> the split it means
SPLIT_KEYWORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                  "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
                  "evaluation": "test"}
_SHARD = re.compile(r"^(?P<split>[\w.-]+?)-\d{5}-of-\d{5}")  # train-00000-of-00002[...].parquet
_KEYWORD = re.compile(r"^(?P<kw>[a-z]+)(?:[-_. ]|\d|$)", re.IGNORECASE)  # train.parquet, test_0.parquet
_SPLIT_ORDER = ("train", "validation", "valid", "val", "test")
_SEARCH_DEPTH = 4  # how deep below ROOT Parquet files are looked for


def _saved_kind(p: Path) -> str | None:
    """``"dict"`` for a ``DatasetDict.save_to_disk`` folder, ``"dataset"`` for a ``Dataset`` one."""
    if not p.is_dir():
        return None
    if (p / "dataset_dict.json").is_file():
        return "dict"
    if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        return "dataset"
    return None


def _scan(root: Path) -> tuple[list[Path], bool]:
    """The ``.parquet`` files under ``root`` (sorted, hidden entries skipped, at most
    :data:`_SEARCH_DEPTH` folders deep) and whether image files were seen. Below ``root`` a folder
    holding images (a class folder) is not searched further, so an image folder is scanned cheaply."""
    found: list[Path] = []
    images = False
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        subdirs: list[Path] = []
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if is_hidden(e.name):
                        continue
                    if e.is_dir():
                        subdirs.append(Path(e.path))
                    elif e.name.lower().endswith(".parquet"):
                        found.append(Path(e.path))
                    elif is_image_name(e.name):
                        images = True
                        if depth > 0:  # a class folder: read no further
                            subdirs = []
                            break
        except OSError:
            continue
        if depth < _SEARCH_DEPTH:
            stack.extend((d, depth + 1) for d in subdirs)
    return sorted(found), images


def is_hf_dataset(path: Path) -> bool:
    """True when ``path`` is a ``save_to_disk`` folder, a ``.parquet`` file, or a folder with
    ``.parquet`` files below it — not a vitflow packed dataset, and not an image folder whose only
    Parquet files are Hub ``metadata.parquet`` files."""
    from vitflow.data.sources.packed import is_packed

    p = Path(path)
    if p.is_file():
        return p.suffix.lower() == ".parquet"
    if not p.is_dir() or is_packed(p):
        return False
    if _saved_kind(p):
        return True
    files, images = _scan(p)
    if images and all(f.name.lower() == "metadata.parquet" for f in files):
        return False
    return bool(files)


def _split_of(rel: PurePosixPath) -> str | None:
    """The split a Parquet file (path relative to ROOT) belongs to: ``train-00000-of-00002`` ->
    ``train`` (any name), ``validation.parquet`` / ``test_0.parquet`` -> the keyword's split, else
    the nearest folder named by a keyword (``train/0000.parquet``); ``None`` when nothing says."""
    stem = rel.name[: -len(".parquet")]
    m = _SHARD.match(stem)
    if m:
        return m["split"]
    m = _KEYWORD.match(stem)
    if m and m["kw"].lower() in SPLIT_KEYWORDS:
        return SPLIT_KEYWORDS[m["kw"].lower()]
    for part in reversed(rel.parts[:-1]):
        if part.lower() in SPLIT_KEYWORDS:
            return SPLIT_KEYWORDS[part.lower()]
    return None


def _parquet_splits(root: Path) -> dict[str, list[Path]]:
    """Split name -> its Parquet files (sorted). When no file names a split every file is
    ``train``; otherwise a file that names none is a split of its own stem (``extra.parquet``)."""
    files, _ = _scan(root)
    named = {f: _split_of(PurePosixPath(f.relative_to(root).as_posix())) for f in files}
    splits: dict[str, list[Path]] = {}
    anything = any(s is not None for s in named.values())
    for f, s in named.items():
        splits.setdefault(s if s is not None else (f.name[: -len(".parquet")] if anything else "train"), []).append(f)
    return splits


def _ordered(names) -> list[str]:
    return sorted(names, key=lambda s: (_SPLIT_ORDER.index(s) if s in _SPLIT_ORDER else len(_SPLIT_ORDER), s))


def hf_split_names(path: Path) -> list[str]:
    """The split names of a Hugging Face dataset (train, validation/valid/val, test first, then
    the rest sorted): a ``DatasetDict`` folder's ``dataset_dict.json`` splits, ``["train"]`` for a
    single ``Dataset`` folder or ``.parquet`` file, else from the Parquet file names
    (:func:`_split_of`).

    Raises:
        DataError: ``path`` is not a Hugging Face dataset, or its ``dataset_dict.json`` is unreadable.
    """
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".parquet":
        return ["train"]
    kind = _saved_kind(p)
    if kind == "dataset":
        return ["train"]
    if kind == "dict":
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{p / 'dataset_dict.json'}: unreadable ({e})") from None
        return _ordered(str(s) for s in splits)
    splits = _parquet_splits(p) if p.is_dir() else {}
    if not splits:
        raise DataError(f"{p} is not a Hugging Face dataset (no dataset_dict.json, state.json or .parquet files)")
    return _ordered(splits)


def locate_split(p: Path, split: str) -> tuple[str, str | None, list[Path]]:
    """``(split as stored, save_to_disk kind or None, Parquet files)`` for ``split`` of ``p``.

    Raises:
        DataError: the split is not there (names ``p`` and the splits found).
    """
    available = hf_split_names(p)
    found = lb.canonical_split(split, available)
    if found is None:
        raise DataError(f"split {split!r} not found in {p}: splits found: {', '.join(available)}")
    kind = _saved_kind(p)
    if kind or p.is_file():
        return found, kind, [] if kind else [p]
    return found, None, _parquet_splits(p)[found]
