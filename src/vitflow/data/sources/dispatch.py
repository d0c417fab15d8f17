"""One place that turns a path into a split's :class:`~vitflow.data.sources.base.ImageSource`: it
finds the source kind (a row of :mod:`vitflow.data.sources.table`: packed dataset, CIFAR python
batches, Hugging Face dataset or Parquet files, label file, image folder, tar, shards, the
embedded digits), maps ``val`` to the data's own ``valid`` / ``validation`` split, and applies
the split expression's slice. It also tells which splits a dataset has (:func:`split_names`) and
resolves ``data.val_split`` / ``data.test_split`` (:func:`resolve_eval_splits`). It names no
kind: what differs between kinds is in their records."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from vitflow.config import DataConfig
from vitflow.config.messages import MESSAGES
from vitflow.data.fixes import apply_fixes, read_fixes
from vitflow.data.remote.fs import is_remote
from vitflow.data.sources import table
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.kind import SourceKind, Where
from vitflow.data.sources.labels import TEST_NAMES, VAL_NAMES, canonical_split
from vitflow.data.sources.remote import remote_kind
from vitflow.data.sources.splits import Split, parse_split

log = logging.getLogger(__name__)


def kind_of(path: str | Path | None, source: str = "auto", label: str = "data.path") -> SourceKind:
    """The record of the kind of data at ``path``: for ``source="auto"`` the first row of
    :data:`~vitflow.data.sources.table.KINDS` that detects it (shard specs first, as given; then a
    URL's kind; then a local path's), else the kind ``source`` names, after checking it fits.

    Raises:
        DataError: an unknown ``source``; ``path`` unset or missing, or not of the kind ``source``
            names (or of none, for ``auto``).
    """
    named = None if source == "auto" else table.kind_named(source)
    if named is not None and not named.needs_path:
        return named
    if path is None:
        raise DataError("data.path is not set: give an image folder, a .tar of one, a label file or a dataset")
    for kind in table.KINDS:  # patterns, lists and URLs of their own: not paths (see data/wds/layout.py)
        if kind.spec and (kind is named or (named is None and kind.detect is not None and kind.detect(str(path)))):
            return kind
    if is_remote(path):  # https://, s3://, ...: see vitflow.data.sources.remote
        return remote_kind(str(path), table.KINDS, source, label)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{label} {p} does not exist")
    for kind in table.KINDS:
        if kind.spec or (named is not None and kind is not named):
            continue
        if kind.detect(p) if kind.detect is not None else kind is named:  # no detect: chosen only by name
            return kind
    raise DataError(f"{label} {p} is not a {(named or table.KINDS[-1]).refusal}")


def source_kind(path: str | Path | None, source: str = "auto", label: str = "data.path") -> str:
    """The name of the kind of data at ``path`` (``folder``, ``tar``, ``labels``, ``wds``, ...; see
    :func:`kind_of`).

    Raises:
        DataError: see :func:`kind_of`.
    """
    return kind_of(path, source, label).name


def _where(kind: SourceKind, path: str | Path | None) -> Where:
    """``path`` as ``kind``'s functions take it: as given for shard specs and built-in data, a
    URL as a string, a local path expanded."""
    if not kind.needs_path:
        return path
    return str(path) if kind.spec or is_remote(path) else Path(path).expanduser()


def split_names(path: str | Path | None, source: str = "auto", cfg: DataConfig | None = None,
                label: str = "data.path") -> list[str]:
    """The names of the splits the data at ``path`` holds (``["train", "val"]``, ...).

    Raises:
        DataError: see :func:`kind_of`, or the data cannot be listed.
    """
    kind = kind_of(path, source, label)
    return kind.split_names(_where(kind, path), cfg or DataConfig())


def open_split(path: str | Path | None, split: str | Split, source: str = "auto",
               classes: list[str] | None = None, label: str = "data.path", cfg: DataConfig | None = None) -> ImageSource:
    """Open one split of a dataset.

    Args:
        path: an image folder, an uncompressed ``.tar``, a label file, a Hugging Face dataset
            (``save_to_disk`` folder or Parquet files), a packed dataset (``vitflow prepare``), a
            CIFAR-10/100 python-batches folder, shards, ... (a kind of
            :mod:`vitflow.data.sources.table`; ignored for built-in data such as ``source="digits"``).
        split: a split expression (see :mod:`vitflow.data.sources.splits`); ``val`` also finds a split
            named ``valid`` or ``validation``. Shards also take a shard pattern.
        source: ``auto`` (detected from ``path``) or a kind's name.
        classes: the class list to label with (from the train split or a checkpoint); ``None``
            uses this split's own (sorted class folders, label values, the dataset's names).
        label: what errors call ``path`` (``data.path``; ``vitflow prepare`` says ``SRC``).
        cfg: the data section, for the table kinds' columns, ``data.root``, ``data.classes``,
            ``data.task`` and ``data.label_separator`` (default: the defaults).
    Returns:
        An :class:`ImageSource` with the selected images, in path (or dataset) order before slicing.
    Raises:
        DataError: missing path, unknown split, no images, an empty class folder of the split that
            defines the classes, class folders not in ``classes``, or multi-label data that is not a
            label table.

    A split opened with ``classes`` (a validation, test or evaluation split) that has no image of
    some of them is opened with a warning naming the split and those classes (its macro averages
    and per-class tables then count only the classes present: :mod:`vitflow.metrics.classification`);
    so is a slice of the split that defines the classes (a training slice without some of them).
    """
    cfg = cfg or DataConfig()
    kind = kind_of(path, source, label)
    where = _where(kind, path)
    if kind.spec:  # a split may be a shard pattern, not a split expression
        return kind.open(where, split if isinstance(split, str) else split.name, classes, cfg)
    sp = parse_split(split) if isinstance(split, str) else split
    if cfg.task == "multilabel" and not kind.table_labels:
        raise DataError(f"data.task=multilabel needs labels from a label file (.csv, .tsv, .jsonl) or a Hugging Face "
                        f"dataset; {label} is a{'n' if kind.name[0] in 'aeiou' else ''} {kind.name} with one class "
                        "per image")
    name = canonical_split(sp.name, kind.split_names(where, cfg)) if sp.name in VAL_NAMES else sp.name
    src = kind.open(where, name or sp.name, classes, cfg)  # not there: the kind's message names what it has
    src = src.subset(sp.select(len(src)))
    if cfg.exclude or cfg.relabel:
        src = apply_fixes(src, read_fixes(cfg.exclude, cfg.relabel), split if isinstance(split, str) else sp.name)
    # a held-out split (labelled with the run's classes), or a slice of the split that defines them
    if (classes is not None or sp.sliced) and (absent := absent_classes(src)):
        shown = ", ".join(absent[:10]) + (f" and {len(absent) - 10} more" if len(absent) > 10 else "")
        what = (f"its macro averages and per-class tables count only the classes present "
                f"({len(src.classes) - len(absent)} of {len(src.classes)})" if classes is not None else
                "a model trained on it never sees them (too few images of them to slice: give them more, or name "
                "the splits)")
        log.warning("split %r of %s has no images of %d of the %d classes (%s): %s",
                    split if isinstance(split, str) else sp.name, path, len(absent), len(src.classes), shown, what)
    return src


def absent_classes(source: ImageSource) -> list[str]:
    """The classes of ``source`` that none of its images has (single-label: no image of the class;
    multi-label: no image with the label), in class order."""
    labels = np.asarray(source.labels)
    present = labels.astype(bool).any(axis=0) if labels.ndim == 2 else np.bincount(
        labels, minlength=len(source.classes)).astype(bool)
    return [c for c, here in zip(source.classes, present) if not here]


def open_training(cfg: DataConfig, label: str = "data.path") -> ImageSource:
    """The training split ``cfg.train_split`` as training reads it: streamed for a kind that
    streams it (shards: :class:`~vitflow.data.wds.kind.ShardStream`), else as :func:`open_split`
    opens it.

    Raises:
        DataError: see :func:`open_split` and the kind's ``stream``.
    """
    kind = kind_of(cfg.path, cfg.source, label)
    if kind.stream is not None:
        if cfg.exclude or cfg.relabel:
            raise DataError(f"data.exclude / data.relabel need images read by index; {label} is streamed ({kind.name}): "
                            "drop or relabel those images when writing the shards")
        return kind.stream(_where(kind, cfg.path), cfg.train_split, cfg)
    return open_split(cfg.path, cfg.train_split, cfg.source, label=label, cfg=cfg)


def find_eval_splits(cfg: DataConfig) -> tuple[str | None, str | None]:
    """``(val_split, test_split)`` expressions for ``cfg``: ``auto`` becomes the data's
    ``val`` / ``valid`` / ``validation`` (resp. ``test``) split when it has one, else ``None``;
    ``none`` becomes ``None``. Both may be ``None`` (a folder of class folders alone)."""
    found: list[str] | None = None

    def resolve(value: str, names: tuple[str, ...]) -> str | None:
        nonlocal found
        if value.lower() == "none":
            return None
        if value != "auto":
            return value
        found = found if found is not None else split_names(cfg.path, cfg.source, cfg)
        return next((n for n in names if n in found), None)

    return resolve(cfg.val_split, VAL_NAMES), resolve(cfg.test_split, TEST_NAMES)


def resolve_eval_splits(cfg: DataConfig) -> tuple[str | None, str | None]:
    """:func:`find_eval_splits`, at least one of them.

    Raises:
        DataError: neither a validation nor a test split (the message lists the splits found and
            how to hold some images out).
    """
    val, test = find_eval_splits(cfg)
    if val is None and test is None:
        found = [] if cfg.val_split == cfg.test_split == "none" else split_names(cfg.path, cfg.source, cfg)
        raise DataError(MESSAGES["no_eval_split"].format(path=cfg.path, splits=", ".join(found),
                                                         train=cfg.train_split))
    return val, test


def scored_split(cfg: DataConfig) -> tuple[str, str]:
    """``(role, split expression)`` a finished model is scored on: the test split, or the
    validation split when the data has no test split (see :func:`resolve_eval_splits`).

    Raises:
        DataError: as :func:`resolve_eval_splits`.
    """
    val, test = resolve_eval_splits(cfg)
    return ("test", test) if test is not None else ("val", val)
