"""Image sources: where a split's images and labels come from.

Layouts (a folder, or an uncompressed ``.tar`` of the same tree read in place)::

    ROOT/[wrapper/]train/<class>/<image>     ROOT/[wrapper/]test/<class>/<image>
    ROOT/<class>/<image>                     (no split folders: this is the "train" split)

``wrapper`` is an optional single top-level folder (``cifar10/`` in the shared CIFAR tar). The
class index is the sorted list of the train split's class-folder names. Hidden files and folders
(names starting with ``.``, e.g. ``.ipynb_checkpoints``) and ``__MACOSX`` are ignored everywhere;
files without an image extension are ignored and counted in a notice. A class folder with no
images is an error that names it.

Members of a tar are indexed once (name, data offset, size) and then read by offset with
``os.pread``: no extraction, no per-image file open, safe to share across forked workers.
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError, decode_image, is_image_name
from vitflow.data.splits import Split, parse_split

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The data cannot be used as configured; the message names the path, split or folder."""


def is_hidden(part: str) -> bool:
    return part.startswith(".") or part == "__MACOSX"


# ---------------------------------------------------------------------------------------------
# readers: relative path -> bytes


class FolderReader:
    """Reads files under a directory ``root``."""

    def __init__(self, root: Path):
        self.root = root

    def describe(self, rel: str) -> str:
        return str(self.root / rel)

    def list(self) -> tuple[dict[str, object], set[str]]:
        files: dict[str, object] = {}
        dirs: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            dirs.update(rel_dir + d for d in dirnames)
            for f in filenames:
                if not is_hidden(f):
                    files[rel_dir + f] = rel_dir + f
        return files, dirs

    def read(self, locator: object) -> bytes:
        with open(self.root / str(locator), "rb") as f:
            return f.read()


_TAR_INDEX: dict[tuple, tuple[dict[str, object], set[str]]] = {}


class TarReader:
    """Reads members of an uncompressed tar by byte offset (``os.pread``)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._pid = -1

    def describe(self, rel: str) -> str:
        return f"{self.path}:{rel}"

    def list(self) -> tuple[dict[str, object], set[str]]:
        st = self.path.stat()
        key = (str(self.path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _TAR_INDEX:  # index each archive once per process
            _TAR_INDEX.clear()
            _TAR_INDEX[key] = self._index()
        return _TAR_INDEX[key]

    def _index(self) -> tuple[dict[str, object], set[str]]:
        files: dict[str, object] = {}
        dirs: set[str] = set()
        try:
            with tarfile.open(self.path, "r:") as tf:
                for m in tf:
                    name = m.name.removeprefix("./")
                    if any(is_hidden(p) for p in name.split("/")):
                        continue
                    parts = name.split("/")
                    dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
                    if m.isdir():
                        dirs.add(name.rstrip("/"))
                    elif m.isfile():
                        files[name] = (m.offset_data, m.size)
        except tarfile.ReadError as e:
            raise DataError(f"{self.path}: not an uncompressed tar archive ({e}); compressed tars cannot be "
                            f"read by offset: decompress it first") from None
        return files, dirs

    def read(self, locator: object) -> bytes:
        offset, size = locator  # type: ignore[misc]
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self._fd, size, offset)

    def __getstate__(self) -> dict:
        return {"path": self.path, "_fd": None, "_pid": -1}


# ---------------------------------------------------------------------------------------------
# sources


class ImageSource:
    """The images of one split.

    Attributes:
        classes: class names; label ``i`` is ``classes[i]``.
        labels: ``int64`` array ``(n,)``.
        fixed_size: ``(H, W)`` when every image has that size and :meth:`load_batch` can gather
            a batch in one op (in-memory and packed raw sources), else ``None``.

    Per-image metadata lives in NumPy arrays, never in Python lists of objects, so forked loader
    workers do not copy them page by page as reference counts change.
    """

    classes: list[str]
    labels: np.ndarray
    fixed_size: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, i: int) -> str:
        """A display name for image ``i`` (file path, ``archive.tar:member``, ``digits[i]``)."""
        raise NotImplementedError

    @property
    def names(self) -> list[str]:
        return [self.name(i) for i in range(len(self))]

    def load(self, i: int) -> torch.Tensor:
        """Image ``i`` as ``uint8`` ``(3, H, W)``. Raises CorruptImageError."""
        raise NotImplementedError

    def encoded(self, i: int) -> bytes | None:
        """The encoded bytes of image ``i`` (``load`` decodes them), or ``None`` for a source of
        decoded pixels. Raises CorruptImageError when unreadable."""
        return None

    def load_batch(self, idx: np.ndarray) -> torch.Tensor:
        """Images ``idx`` as one ``uint8`` ``(B, 3, H, W)`` tensor (only when ``fixed_size``; leave
        out the images :meth:`known_unreadable` names first)."""
        return torch.stack([self.load(int(i)) for i in idx])

    def known_unreadable(self, idx: np.ndarray) -> tuple[np.ndarray, list[tuple[str, str]]]:
        """Split ``idx`` into the images to load and those already known to be unreadable (found
        when the source was cached in RAM) as ``(name, reason)``. Sources that find out only when
        loading keep every index."""
        return idx, []

    def subset(self, idx: np.ndarray) -> "ImageSource":
        raise NotImplementedError


class FileSource(ImageSource):
    """Encoded image files read through a :class:`FolderReader` (``keys`` are paths relative to
    the root) or a :class:`TarReader` (``keys`` are member names, ``spans`` their
    ``(offset, size)``)."""

    def __init__(self, classes: list[str], labels: np.ndarray, reader: "FolderReader | TarReader",
                 keys: np.ndarray, spans: np.ndarray | None = None):
        self.classes, self.labels, self.reader, self.keys, self.spans = classes, labels, reader, keys, spans

    def name(self, i: int) -> str:
        return self.reader.describe(self.keys[i].decode())

    def read(self, i: int) -> bytes:
        """The encoded bytes of image ``i``. Raises CorruptImageError when unreadable."""
        try:
            if self.spans is not None:
                return self.reader.read((int(self.spans[i, 0]), int(self.spans[i, 1])))
            return self.reader.read(self.keys[i].decode())
        except OSError as e:
            raise CorruptImageError(self.name(i), f"cannot read: {e}") from None

    def load(self, i: int) -> torch.Tensor:
        return decode_image(self.read(i), self.name(i))

    def encoded(self, i: int) -> bytes:
        return self.read(i)

    def subset(self, idx: np.ndarray) -> "FileSource":
        return FileSource(self.classes, self.labels[idx], self.reader, self.keys[idx],
                          None if self.spans is None else self.spans[idx])


class TensorSource(ImageSource):
    """Images already decoded in memory: ``images`` is ``uint8`` ``(n, 3, H, W)``; ``ids`` are
    the images' indices in the original collection, named ``prefix[id]`` or, when the images were
    decoded from another source ``base``, by that source's names. ``errors`` gives, by id, why an
    image could not be decoded (its row holds zeros): loading it raises CorruptImageError, as
    reading the file would, and :meth:`known_unreadable` names it."""

    def __init__(self, classes: list[str], labels: np.ndarray, images: torch.Tensor, prefix: str,
                 ids: np.ndarray | None = None, base: ImageSource | None = None, errors: dict[int, str] | None = None):
        self.classes, self.labels, self.images, self.prefix, self.base = classes, labels, images, prefix, base
        self.ids = np.arange(len(labels)) if ids is None else ids
        self.fixed_size = (images.shape[-2], images.shape[-1])
        self.errors = errors or {}
        self._bad_ids = np.fromiter(self.errors, dtype=np.int64, count=len(self.errors))

    def name(self, i: int) -> str:
        return self.base.name(int(self.ids[i])) if self.base is not None else f"{self.prefix}[{self.ids[i]}]"

    def load(self, i: int) -> torch.Tensor:
        if self.errors and int(self.ids[i]) in self.errors:
            raise CorruptImageError(self.name(i), self.errors[int(self.ids[i])])
        return self.images[i]

    def load_batch(self, idx: np.ndarray) -> torch.Tensor:
        return self.images[torch.from_numpy(np.asarray(idx, dtype=np.int64))]

    def known_unreadable(self, idx: np.ndarray) -> tuple[np.ndarray, list[tuple[str, str]]]:
        if not self.errors:
            return idx, []
        idx = np.asarray(idx)
        bad = np.isin(self.ids[idx], self._bad_ids)
        return idx[~bad], [(self.name(int(i)), self.errors[int(self.ids[i])]) for i in idx[bad]]

    def subset(self, idx: np.ndarray) -> "TensorSource":
        return TensorSource(self.classes, self.labels[idx], self.load_batch(idx), self.prefix, self.ids[idx],
                            self.base, self.errors)


def digits_source() -> TensorSource:
    """scikit-learn's handwritten digits (UCI ML hand-written digits; Alpaydin & Kaynak 1998):
    1,797 real 8x8 grayscale scans of digits 0-9, shipped inside scikit-learn, as RGB ``uint8``
    ``(1797, 3, 8, 8)`` (16 grey levels scaled to 0..255). It has one split, ``train``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    gray = torch.from_numpy(np.round(d.images * (255.0 / 16.0))).to(torch.uint8)
    images = gray.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return TensorSource([str(c) for c in range(10)], d.target.astype(np.int64), images, "digits")


def export_samples(source: ImageSource, folder: str | Path, n: int = 10) -> list[Path]:
    """Write the first ``n`` readable images of ``source`` as PNG files ``NN_<class>.png`` in
    ``folder`` (for trying ``vitflow predict`` on data that has no files of its own; ``NN`` is the
    index in ``source``). Returns the paths."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for i in range(len(source)):
        if len(paths) == n:
            break
        try:
            image = source.load(i)
        except CorruptImageError:
            continue  # reported by the passes over the split
        path = folder / f"{i:02d}_{source.classes[int(source.labels[i])]}.png"
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# building a split


def _relabel(src: ImageSource, classes: list[str] | None) -> ImageSource:
    """Check that a source with its own class list matches the training classes."""
    if classes is not None and list(classes) != list(src.classes):
        raise DataError(f"the data's classes {src.classes[:5]}... differ from the training classes {classes[:5]}...")
    return src


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


def _split_prefix(files: dict[str, object], dirs: set[str], split: str, where: str) -> str:
    """The folder prefix (``""`` or ``"a/b/"``) that holds ``split``'s class folders."""
    tops = {p.split("/", 1)[0] for p in dirs if "/" not in p}
    loose = [f for f in files if "/" not in f]
    candidates = [""]
    if len(tops) == 1 and not loose:  # a single wrapper folder, e.g. cifar10/
        candidates.append(next(iter(tops)) + "/")
    for base in candidates:
        if f"{base}{split}" in dirs:
            return f"{base}{split}/"
    splits = sorted({d[len(b):] for b in candidates for d in dirs if d.startswith(b) and "/" not in d[len(b):]
                     and d[len(b):] in ("train", "test", "val", "validation")})
    if split == "train" and not splits:
        return candidates[-1]  # class folders directly under the root (or its wrapper)
    hint = (f"; splits found: {', '.join(splits)}" if splits else
            "; without split folders the root's class folders form the 'train' split: select parts of it "
            "with slices such as data.train_split='train[:90%]' data.test_split='train[90%:]'")
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
    return FileSource(["images"], np.zeros(len(rels), dtype=np.int64), reader, np.array([r.encode() for r in rels]),
                      spans)


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
    from vitflow.data.packed import cifar_batches_source, is_cifar_batches, is_packed, open_packed

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
    reader: FolderReader | TarReader = FolderReader(p) if kind == "folder" else TarReader(p)
    files, dirs = reader.list()
    prefix = _split_prefix(files, dirs, sp.name, str(p))

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
        _note_ignored(f"{p} split {sp.name!r}", ignored)
    if classes is None:
        classes = list(per_class)
    unknown = sorted(set(per_class) - set(classes))
    if unknown:
        raise DataError(f"{p} split {sp.name!r} has class folders not in the training classes: {unknown[:5]}")
    index = {c: i for i, c in enumerate(classes)}
    rels = sorted(r for c in per_class for r in per_class[c])
    labels = np.array([index[r[len(prefix):].split("/", 1)[0]] for r in rels], dtype=np.int64)
    spans = np.array([files[r] for r in rels], dtype=np.int64).reshape(-1, 2) if kind == "tar" else None
    src = FileSource(list(classes), labels, reader, np.array([r.encode() for r in rels]), spans)
    return src.subset(sp.select(len(src)))
