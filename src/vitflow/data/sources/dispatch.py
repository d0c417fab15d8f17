"""One place that turns a path into a split's :class:`~vitflow.data.sources.base.ImageSource`: it
detects the source kind (packed dataset, CIFAR python batches, Hugging Face dataset or Parquet
files, label file, image folder, tar, the embedded digits), maps ``val`` to the data's own
``valid`` / ``validation`` split, and applies the split expression's slice. It also tells which
splits a dataset has (:func:`split_names`) and resolves ``data.val_split`` / ``data.test_split``
(:func:`resolve_eval_splits`). A new source kind plugs in here."""

from __future__ import annotations

import tarfile
from pathlib import Path

from vitflow.config import DataConfig
from vitflow.data.remote.fs import is_remote
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.cifar import cifar_batches_source, is_cifar_batches
from vitflow.data.sources.digits import digits_source
from vitflow.data.sources.folder import folder_split_names, open_folder_split
from vitflow.data.sources.hf import open_hf_split
from vitflow.data.sources.hflayout import hf_split_names, is_hf_dataset
from vitflow.data.sources.labelfile import is_label_file, label_file_splits, open_label_file_split
from vitflow.data.sources.labels import TEST_NAMES, VAL_NAMES, canonical_split
from vitflow.data.sources.packed import is_packed, open_packed, packed_split_names
from vitflow.data.sources.remote import remote_kind
from vitflow.data.sources.splits import Split, parse_split
from vitflow.data.wds.layout import is_wds, open_wds_split, wds_split_names

TABLE_KINDS = ("labels", "hf")  # kinds whose labels come from a column (and may be multi-label)


def _relabel(src: ImageSource, classes: list[str] | None) -> ImageSource:
    """Check that a source with its own class list matches the training classes."""
    if classes is not None and list(classes) != list(src.classes):
        raise DataError(f"the data's classes {src.classes[:5]}... differ from the training classes {classes[:5]}...")
    return src


def source_kind(path: str | Path | None, source: str = "auto", label: str = "data.path") -> str:
    """The kind of data at ``path``: ``digits``, ``packed``, ``cifar``, ``hf``, ``labels``,
    ``folder``, ``tar`` or ``wds`` (WebDataset shards; ``source`` when it is not ``auto``, after checking it fits).

    Raises:
        DataError: ``path`` unset or missing, or not of the kind ``source`` names.
    """
    if source == "digits":
        return "digits"
    if path is None:
        raise DataError("data.path is not set: give an image folder, a .tar of one, a label file or a dataset")
    if source == "wds" or (source == "auto" and is_wds(str(path))):
        return "wds"  # WebDataset shards: a pattern, list or URL is not a path (see data/wds/layout.py)
    if is_remote(path):  # https://, s3://, ...: see vitflow.data.sources.remote
        return remote_kind(str(path), source, label)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{label} {p} does not exist")
    detected = {"packed": is_packed, "cifar": is_cifar_batches, "hf": is_hf_dataset, "labels": is_label_file}
    for kind, test in detected.items():
        if source in ("auto", kind) and test(p):
            return kind
    if source in detected:
        what = {"packed": "vitflow packed dataset", "cifar": "CIFAR batches folder",
                "hf": "Hugging Face dataset (save_to_disk folder or Parquet files)",
                "labels": "label file (.csv, .tsv or .jsonl)"}[source]
        raise DataError(f"{label} {p} is not a {what}")
    kind = source if source != "auto" else ("folder" if p.is_dir() else "tar")
    if kind == "folder" and not p.is_dir():
        raise DataError(f"{label} {p} is not a directory (data.source=folder)")
    if kind == "tar" and (p.is_dir() or not tarfile.is_tarfile(p)):
        raise DataError(f"{label} {p} is not a tar archive, a label file (.csv, .tsv, .jsonl) or a dataset; "
                        "give an image folder or a .tar of one")
    return kind


def split_names(path: str | Path | None, source: str = "auto", cfg: DataConfig | None = None) -> list[str]:
    """The names of the splits the data at ``path`` holds (``["train", "val"]``, ...)."""
    kind = source_kind(path, source)
    if kind == "digits":
        return ["train"]
    if kind == "wds":
        return wds_split_names(str(path))
    p = str(path) if is_remote(path) else Path(path).expanduser()
    if kind == "packed":
        return packed_split_names(p)
    if kind == "cifar":
        return ["train", "test"]
    if kind == "hf":
        return hf_split_names(p)
    if kind == "labels":
        return label_file_splits(p, (cfg or DataConfig()).split_column)
    return folder_split_names(p, kind)


def open_split(path: str | Path | None, split: str | Split, source: str = "auto",
               classes: list[str] | None = None, label: str = "data.path", cfg: DataConfig | None = None) -> ImageSource:
    """Open one split of a dataset.

    Args:
        path: an image folder, an uncompressed ``.tar``, a label file, a Hugging Face dataset
            (``save_to_disk`` folder or Parquet files), a packed dataset (``vitflow prepare``) or a
            CIFAR-10/100 python-batches folder (ignored for ``source="digits"``).
        split: a split expression (see :mod:`vitflow.data.sources.splits`); ``val`` also finds a split
            named ``valid`` or ``validation``.
        source: ``auto`` (detected from ``path``) or a kind of :func:`source_kind`.
        classes: the class list to label with (from the train split or a checkpoint); ``None``
            uses this split's own (sorted class folders, label values, the dataset's names).
        label: what errors call ``path`` (``data.path``; ``vitflow prepare`` says ``SRC``).
        cfg: the data section, for the table kinds' columns, ``data.root``, ``data.classes``,
            ``data.task`` and ``data.label_separator`` (default: the defaults).
    Returns:
        An :class:`ImageSource` with the selected images, in path (or dataset) order before slicing.
    Raises:
        DataError: missing path, unknown split, no images, an empty class folder, class folders
            not in ``classes``, or multi-label data that is not a label table.
    """
    cfg = cfg or DataConfig()
    kind = source_kind(path, source, label)
    if kind == "wds":  # a split may be a shard pattern, not a split expression
        return open_wds_split(str(path), split if isinstance(split, str) else split.name, classes, cfg.classes)
    sp = parse_split(split) if isinstance(split, str) else split
    if cfg.task == "multilabel" and kind not in TABLE_KINDS:
        raise DataError(f"data.task=multilabel needs labels from a label file (.csv, .tsv, .jsonl) or a Hugging Face "
                        f"dataset; {label} is a{'n' if kind[0] in 'aeiou' else ''} {kind} with one class per image")
    if kind == "digits":
        if sp.name != "train":
            raise DataError(f"the digits data has one split, 'train' (got {sp.name!r}); "
                            "hold out images with slices such as 'train[80%:]'")
        src = digits_source()
        return src.subset(sp.select(len(src)))
    p = str(path) if is_remote(path) else Path(path).expanduser()
    name = canonical_split(sp.name, split_names(p, kind, cfg)) if sp.name in VAL_NAMES else sp.name
    name = name or sp.name  # not there: the source's own message names what it has
    if kind == "packed":
        src = _relabel(open_packed(p, name), classes)
    elif kind == "cifar":
        src = _relabel(cifar_batches_source(p, name), classes)
    elif kind == "hf":
        src = open_hf_split(p, name, classes, cfg.image_column, cfg.label_column, cfg.task == "multilabel",
                            cfg.label_separator, cfg.classes)
    elif kind == "labels":
        src = open_label_file_split(p, name, classes, cfg.root, cfg.image_column, cfg.label_column, cfg.split_column,
                                    cfg.task == "multilabel", cfg.label_separator, cfg.classes)
    else:
        src = open_folder_split(p, kind, name, classes)
    return src.subset(sp.select(len(src)))


def resolve_eval_splits(cfg: DataConfig) -> tuple[str | None, str | None]:
    """``(val_split, test_split)`` expressions for ``cfg``: ``auto`` becomes the data's
    ``val`` / ``valid`` / ``validation`` (resp. ``test``) split when it has one, else ``None``;
    ``none`` becomes ``None``.

    Raises:
        DataError: neither a validation nor a test split (the message lists the splits found and
            how to hold some images out).
    """
    found: list[str] | None = None

    def resolve(value: str, names: tuple[str, ...]) -> str | None:
        nonlocal found
        if value.lower() == "none":
            return None
        if value != "auto":
            return value
        found = found if found is not None else split_names(cfg.path, cfg.source, cfg)
        return next((n for n in names if n in found), None)

    val, test = resolve(cfg.val_split, VAL_NAMES), resolve(cfg.test_split, TEST_NAMES)
    if val is None and test is None:
        raise DataError(f"{cfg.path} has no validation or test split (splits: {', '.join(found or [])}): hold out "
                        f"part of the training images with data.train_split='{cfg.train_split}[:90%]' "
                        f"data.val_split='{cfg.train_split}[90%:]'")
    return val, test


def scored_split(cfg: DataConfig) -> tuple[str, str]:
    """``(role, split expression)`` a finished model is scored on: the test split, or the
    validation split when the data has no test split (see :func:`resolve_eval_splits`).

    Raises:
        DataError: as :func:`resolve_eval_splits`.
    """
    val, test = resolve_eval_splits(cfg)
    return ("test", test) if test is not None else ("val", val)
