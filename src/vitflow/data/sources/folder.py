"""Image folders and tars of one: the split layout, class folders and what is ignored.

Layouts (a folder, or an uncompressed ``.tar`` of the same tree read in place)::

    ROOT/[wrapper/]train/<class>/<image>     ROOT/[wrapper/]test/<class>/<image>
    ROOT/<class>/<image>                     (no split folders: this is the "train" split)

``wrapper`` is an optional single top-level folder (``cifar10/`` in the shared CIFAR tar). The
class index is the sorted list of the train split's class-folder names. Hidden files and folders
(names starting with ``.``, e.g. ``.ipynb_checkpoints``) and ``__MACOSX`` are ignored everywhere;
files without an image extension are ignored and counted in a notice. A class folder with no
images is an error that names it.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from vitflow.data.decode import is_image_name
from vitflow.data.remote.fs import basename
from vitflow.data.sources.base import DataError, FileSource
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.readers import FolderReader, TarReader, is_hidden

log = logging.getLogger(__name__)


_NOTED: set[tuple] = set()


def _note_ignored(where: str, ignored: dict[str, list[str]]) -> None:
    """Warn about the files a split's folder holds but does not use (``ignored``: kind -> paths):
    how many of each kind, with up to three example paths. Once per source and process, however
    many slices of the split are opened (``train[:90%]`` and ``train[90%:]`` warn once)."""
    key = (where, *((what, len(paths), paths[0]) for what, paths in ignored.items()))
    if key in _NOTED:
        return
    _NOTED.add(key)
    log.warning("%s: ignored %s", where, "; ".join(
        f"{len(paths)} {what} (e.g. {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})"
        for what, paths in ignored.items()))


SPLIT_FOLDERS = ("train", "val", "valid", "validation", "test")


def _candidates(files: Iterable[str], dirs: set[str]) -> list[str]:
    """Folder prefixes that may hold the split folders: the root, and a single wrapper folder
    (e.g. ``cifar10/``) when the root holds nothing else."""
    tops = {p.split("/", 1)[0] for p in dirs if "/" not in p}
    loose = [f for f in files if "/" not in f]
    return [""] + ([next(iter(tops)) + "/"] if len(tops) == 1 and not loose else [])


def _splits_found(dirs: set[str], candidates: list[str]) -> list[str]:
    return sorted({d[len(b):] for b in candidates for d in dirs if d.startswith(b) and "/" not in d[len(b):]
                   and d[len(b):] in SPLIT_FOLDERS})


def split_folders(files: Iterable[str], dirs: set[str]) -> list[str]:
    """The split folders (``train``, ``val``, ``valid``, ``validation``, ``test``) in a listing of a
    folder or tar (``files``, ``dirs``: paths relative to its root; the top of it is enough);
    ``["train"]`` when it has none (its class folders are the train split)."""
    return _splits_found(dirs, _candidates(files, dirs)) or ["train"]


def _top_listing(root: Path) -> tuple[set[str], set[str]]:
    """The part of :meth:`FolderReader.list` that :func:`_candidates` and :func:`_splits_found`
    read — the files and folders at the top of ``root``, and the folders inside a lone top folder —
    without walking the whole tree (a photo folder may hold millions of files)."""
    def entries(folder: Path, prefix: str) -> tuple[set[str], set[str]]:
        files, dirs = set(), set()
        with os.scandir(folder) as it:
            for e in it:
                if not is_hidden(e.name):
                    (dirs if e.is_dir() else files).add(prefix + e.name)
        return files, dirs

    files, dirs = entries(root, "")
    if len(dirs) == 1 and not files:
        top = next(iter(dirs))
        dirs |= entries(root / top, top + "/")[1]
    return files, dirs


def _split_prefix(files: dict[str, object], dirs: set[str], split: str, where: str) -> str:
    """The folder prefix (``""`` or ``"a/b/"``) that holds ``split``'s class folders."""
    candidates = _candidates(files, dirs)
    for base in candidates:
        if f"{base}{split}" in dirs:
            return f"{base}{split}/"
    splits = _splits_found(dirs, candidates)
    if split == "train" and not splits:
        return candidates[-1]  # class folders directly under the root (or its wrapper)
    hint = (f"; splits found: {', '.join(splits)}" if splits else
            "; without split folders the root's class folders form the 'train' split: select parts of it "
            "with slices such as data.train_split='train[:90%]' data.val_split='train[90%:]'")
    raise DataError(f"split {split!r} not found in {where}: expected a folder {split}/<class>/<image>{hint}")


def open_images(path: str | Path) -> FileSource:
    """Every image file under a folder or in a tar, in path order, without class folders: one
    class ``"images"``, label 0 (for throughput measurements and packing unlabeled sets).

    Raises:
        DataError: missing path or no images.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p} does not exist")
    reader: FolderReader | TarReader = FolderReader(p) if p.is_dir() else TarReader(p)
    files, _ = reader.list()
    rels = sorted(r for r in files if is_image_name(r))
    if not rels:
        raise DataError(f"no images in {p}")
    spans = np.array([files[r] for r in rels], dtype=np.int64).reshape(-1, 2) if isinstance(reader, TarReader) else None
    return FileSource(["images"], np.zeros(len(rels), dtype=np.int64), reader, np.array([os.fsencode(r) for r in rels]),
                      spans)


def open_class_folders(p: Path, split: str, classes: list[str] | None = None,
                       read_with: type[FolderReader] | type[TarReader] = FolderReader) -> FileSource:
    """The images of split ``split`` in the folder (``read_with=FolderReader``) or tar
    (``TarReader``) at ``p``, in path order, labelled by class folder (``classes``: the list to
    label with; ``None``: this split's sorted class folders).

    Raises:
        DataError: unknown split, no class folders, an empty class folder, or class folders not
        in ``classes``.
    """
    reader = read_with(p)
    files, dirs = reader.list()
    prefix = _split_prefix(files, dirs, split, str(p))

    class_dirs = sorted(d[len(prefix):] for d in dirs if d.startswith(prefix) and "/" not in d[len(prefix):]
                        and d != prefix.rstrip("/"))
    per_class: dict[str, list[str]] = {c: [] for c in class_dirs}
    ignored: dict[str, list[str]] = {}
    for rel in sorted(files):
        if not rel.startswith(prefix):
            continue
        parts = rel[len(prefix):].split("/")
        if len(parts) < 2:
            ignored.setdefault("files outside class folders", []).append(reader.describe(rel))
        elif not is_image_name(rel):
            ignored.setdefault("non-image files", []).append(reader.describe(rel))
        else:
            per_class[parts[0]].append(rel)
    empty = [c for c, items in per_class.items() if not items]
    if empty:
        raise DataError(f"class folder(s) with no images in {reader.describe(prefix + empty[0])}"
                        + (f" and {len(empty) - 1} more" if len(empty) > 1 else "")
                        + ": add images or remove the folder")
    if not per_class:
        raise DataError(f"no class folders in {reader.describe(prefix) or p}: expected <class>/<image> folders")
    if ignored:
        _note_ignored(f"{p} split {split!r}", ignored)
    if classes is None:
        classes = list(per_class)
    unknown = sorted(set(per_class) - set(classes))
    if unknown:
        raise DataError(f"{p} split {split!r} has class folders not in the training classes: {unknown[:5]}")
    index = {c: i for i, c in enumerate(classes)}
    rels = sorted(r for c in per_class for r in per_class[c])
    labels = np.array([index[r[len(prefix):].split("/", 1)[0]] for r in rels], dtype=np.int64)
    spans = np.array([files[r] for r in rels], dtype=np.int64).reshape(-1, 2) if read_with is TarReader else None
    return FileSource(list(classes), labels, reader, np.array([os.fsencode(r) for r in rels]), spans)


def is_tar(p: Path) -> bool:
    """True for a file that is a tar archive (of class folders, as this module reads it)."""
    return p.is_file() and tarfile.is_tarfile(p)


FOLDER = SourceKind("folder", "an image folder: <class>/<image>, or train/ val/ test/ folders of them",
                    lambda where, cfg: split_folders(*_top_listing(where)),
                    lambda where, split, classes, cfg: open_class_folders(where, split, classes),
                    detect=Path.is_dir, what="directory (data.source=folder)")
# the last row of the table: what data.source=auto says a path that no kind detects is not
TAR = SourceKind("tar", "an uncompressed .tar of an image folder, read in place",
                 lambda where, cfg: split_folders(*TarReader(where).list()),  # a tar's index is kept
                 lambda where, split, classes, cfg: open_class_folders(where, split, classes, TarReader),
                 detect=is_tar, what="tar archive, a label file (.csv, .tsv, .jsonl) or a dataset; give an image "
                 "folder or a .tar of one", remote=lambda url: basename(url).lower().endswith(".tar"),
                 stream_access=True)
