"""One place that turns a path into a split's :class:`~vitflow.data.sources.ImageSource`: it
detects the source kind (packed dataset, CIFAR python batches, image folder, tar, the embedded
digits) and applies the split expression's slice. A new source kind plugs in here."""

from __future__ import annotations

import tarfile
from pathlib import Path

from vitflow.data.cifar import cifar_batches_source, is_cifar_batches
from vitflow.data.digits import digits_source
from vitflow.data.folder import open_folder_split
from vitflow.data.packed import is_packed, open_packed
from vitflow.data.sources import DataError, ImageSource
from vitflow.data.splits import Split, parse_split


def _relabel(src: ImageSource, classes: list[str] | None) -> ImageSource:
    """Check that a source with its own class list matches the training classes."""
    if classes is not None and list(classes) != list(src.classes):
        raise DataError(f"the data's classes {src.classes[:5]}... differ from the training classes {classes[:5]}...")
    return src


def open_split(path: str | Path | None, split: str | Split, source: str = "auto",
               classes: list[str] | None = None, label: str = "data.path") -> ImageSource:
    """Open one split of a dataset.

    Args:
        path: an image folder, an uncompressed ``.tar``, a packed dataset (``vitflow prepare``)
            or a CIFAR-10/100 python-batches folder (ignored for ``source="digits"``).
        split: a split expression (see :mod:`vitflow.data.splits`).
        source: ``auto`` (detected from ``path``), ``folder``, ``tar``, ``packed``, ``cifar`` or
            ``digits``.
        classes: the class list to label with (from the train split or a checkpoint); ``None``
            uses this split's sorted class folders.
        label: what errors call ``path`` (``data.path``; ``vitflow prepare`` says ``SRC``).
    Returns:
        An :class:`ImageSource` with the selected images, sorted by path before slicing.
    Raises:
        DataError: missing path, unknown split, no images, an empty class folder, or class
            folders not in ``classes``.
    """
    sp = parse_split(split) if isinstance(split, str) else split
    if source == "digits":
        if sp.name != "train":
            raise DataError(f"the digits data has one split, 'train' (got {sp.name!r}); "
                            "hold out images with slices such as 'train[80%:]'")
        src = digits_source()
        return src.subset(sp.select(len(src)))
    if path is None:
        raise DataError("data.path is not set: give an image folder or a .tar of one")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{label} {p} does not exist")
    if source in ("auto", "packed") and is_packed(p):
        src = _relabel(open_packed(p, sp.name), classes)
        return src.subset(sp.select(len(src)))
    if source in ("auto", "cifar") and is_cifar_batches(p):
        src = _relabel(cifar_batches_source(p, sp.name), classes)
        return src.subset(sp.select(len(src)))
    if source in ("packed", "cifar"):
        raise DataError(f"{label} {p} is not a {'vitflow packed dataset' if source == 'packed' else 'CIFAR batches folder'}")
    kind = source if source != "auto" else ("folder" if p.is_dir() else "tar")
    if kind == "folder" and not p.is_dir():
        raise DataError(f"{label} {p} is not a directory (data.source=folder)")
    if kind == "tar" and (p.is_dir() or not tarfile.is_tarfile(p)):
        raise DataError(f"{label} {p} is not a tar archive; give an image folder or a .tar of one")
    src = open_folder_split(p, kind, sp.name, classes)
    return src.subset(sp.select(len(src)))
