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
from collections import Counter
from dataclasses import dataclass, field
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


@dataclass
class ImageSource:
    """The images of one split.

    Attributes:
        classes: class names; label ``i`` is ``classes[i]``.
        labels: ``int64`` array ``(n,)``.
        names: a display name per image (file path, ``tar:member`` or ``digits[i]``).
    """

    classes: list[str]
    labels: np.ndarray
    names: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, i: int) -> torch.Tensor:
        """Image ``i`` as ``uint8`` ``(3, H, W)``. Raises CorruptImageError."""
        raise NotImplementedError

    def subset(self, idx: np.ndarray) -> "ImageSource":
        raise NotImplementedError


@dataclass
class FileSource(ImageSource):
    """Encoded image files read through a :class:`FolderReader` or :class:`TarReader`."""

    reader: FolderReader | TarReader = None  # type: ignore[assignment]
    locators: list[object] = field(default_factory=list)

    def load(self, i: int) -> torch.Tensor:
        try:
            data = self.reader.read(self.locators[i])
        except OSError as e:
            raise CorruptImageError(self.names[i], f"cannot read: {e}") from None
        return decode_image(data, self.names[i])

    def subset(self, idx: np.ndarray) -> "FileSource":
        return FileSource(self.classes, self.labels[idx], [self.names[i] for i in idx], self.reader,
                          [self.locators[i] for i in idx])


@dataclass
class TensorSource(ImageSource):
    """Images already decoded in memory: ``images`` is ``uint8`` ``(n, 3, H, W)``."""

    images: torch.Tensor = None  # type: ignore[assignment]

    def load(self, i: int) -> torch.Tensor:
        return self.images[i]

    def subset(self, idx: np.ndarray) -> "TensorSource":
        return TensorSource(self.classes, self.labels[idx], [self.names[i] for i in idx],
                            self.images[torch.as_tensor(idx, dtype=torch.long)])


def digits_source() -> TensorSource:
    """scikit-learn's handwritten digits (UCI ML hand-written digits; Alpaydin & Kaynak 1998):
    1,797 real 8x8 grayscale scans of digits 0-9, shipped inside scikit-learn, as RGB ``uint8``
    ``(1797, 3, 8, 8)`` (16 grey levels scaled to 0..255). It has one split, ``train``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    gray = torch.from_numpy(np.round(d.images * (255.0 / 16.0))).to(torch.uint8)
    images = gray.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return TensorSource([str(c) for c in range(10)], d.target.astype(np.int64),
                        [f"digits[{i}]" for i in range(len(d.target))], images)


def export_samples(source: ImageSource, folder: str | Path, n: int = 10) -> list[Path]:
    """Write the first ``n`` images of ``source`` as PNG files ``NN_<class>.png`` in ``folder``
    (for trying ``vitflow predict`` on data that has no files of its own). Returns the paths."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(min(n, len(source))):
        path = folder / f"{i:02d}_{source.classes[source.labels[i]]}.png"
        Image.fromarray(source.load(i).permute(1, 2, 0).numpy()).save(path)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# building a split


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


def open_split(path: str | Path | None, split: str | Split, source: str = "auto",
               classes: list[str] | None = None) -> ImageSource:
    """Open one split of a dataset.

    Args:
        path: an image folder or an uncompressed ``.tar`` (ignored for ``source="digits"``).
        split: a split expression (see :mod:`vitflow.data.splits`).
        source: ``auto`` (folder or tar from ``path``), ``folder``, ``tar`` or ``digits``.
        classes: the class list to label with (from the train split or a checkpoint); ``None``
            uses this split's sorted class folders.
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
        raise DataError(f"data.path {p} does not exist")
    kind = source if source != "auto" else ("folder" if p.is_dir() else "tar")
    if kind == "folder" and not p.is_dir():
        raise DataError(f"data.path {p} is not a directory (data.source=folder)")
    if kind == "tar" and (p.is_dir() or not tarfile.is_tarfile(p)):
        raise DataError(f"data.path {p} is not a tar archive; give an image folder or a .tar of one")
    reader: FolderReader | TarReader = FolderReader(p) if kind == "folder" else TarReader(p)
    files, dirs = reader.list()
    prefix = _split_prefix(files, dirs, sp.name, str(p))

    class_dirs = sorted(d[len(prefix):] for d in dirs if d.startswith(prefix) and "/" not in d[len(prefix):]
                        and d != prefix.rstrip("/"))
    per_class: dict[str, list[str]] = {c: [] for c in class_dirs}
    skipped: Counter[str] = Counter()
    for rel in sorted(files):
        if not rel.startswith(prefix):
            continue
        parts = rel[len(prefix):].split("/")
        if len(parts) < 2:
            skipped["files outside class folders"] += 1
        elif not is_image_name(rel):
            skipped["non-image files"] += 1
        else:
            per_class[parts[0]].append(rel)
    if skipped:
        log.warning("%s split %r: ignored %s", p, sp.name, ", ".join(f"{n} {what}" for what, n in skipped.items()))
    empty = [c for c, items in per_class.items() if not items]
    if empty:
        raise DataError(f"class folder(s) with no images in {reader.describe(prefix + empty[0])}"
                        + (f" and {len(empty) - 1} more" if len(empty) > 1 else "")
                        + ": add images or remove the folder")
    if not per_class:
        raise DataError(f"no class folders in {reader.describe(prefix) or p}: expected <class>/<image> folders")
    if classes is None:
        classes = list(per_class)
    unknown = sorted(set(per_class) - set(classes))
    if unknown:
        raise DataError(f"{p} split {sp.name!r} has class folders not in the training classes: {unknown[:5]}")
    index = {c: i for i, c in enumerate(classes)}
    rels = [r for c in per_class for r in per_class[c]]
    labels = np.array([index[c] for c in per_class for _ in per_class[c]], dtype=np.int64)
    order = np.argsort(np.array(rels, dtype=object), kind="stable")
    rels, labels = [rels[i] for i in order], labels[order]
    src = FileSource(list(classes), labels, [reader.describe(r) for r in rels], reader, [files[r] for r in rels])
    return src.subset(sp.select(len(src)))
