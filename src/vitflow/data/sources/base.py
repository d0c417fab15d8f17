"""Image sources: the images and labels of one split, whatever they are stored in.

:class:`ImageSource` is the interface the loaders read; :class:`FileSource` reads encoded files
(a folder or a tar, through :mod:`vitflow.data.sources.readers`), :class:`TensorSource` holds decoded
pixels in memory. Packed datasets (:mod:`vitflow.data.sources.packed`), the RAM cache
(:mod:`vitflow.data.cache`), CIFAR batches and the embedded digits build on them;
:func:`vitflow.data.sources.dispatch.open_split` picks the source kind for a path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError, decode_image, image_size


class DataError(ValueError):
    """The data cannot be used as configured; the message names the path, split or folder."""


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

    def image_size(self, i: int) -> tuple[int, int]:
        """``(width, height)`` of image ``i`` in pixels: from the header of its encoded bytes (no
        decode), or from the decoded image. Raises CorruptImageError."""
        data = self.encoded(i)
        if data is None:
            h, w = self.load(i).shape[-2:]
            return w, h
        return image_size(data, self.name(i))

    def sample_sizes(self, n: int) -> list[tuple[int, int]]:
        """``(width, height)`` in pixels of up to ``n`` images spread evenly over the source (from
        their headers where encoded; what a training plan samples). Unreadable ones are left out."""
        sizes = []
        for i in np.linspace(0, len(self) - 1, min(n, len(self))).astype(int):
            try:
                sizes.append(self.image_size(int(i)))
            except CorruptImageError:
                continue
        return sizes

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

    def worker_problem(self) -> str | None:
        """Why this source cannot be handed to loader worker processes (one line naming what and how
        to fix it), or ``None`` when it can (every source vitflow opens itself can)."""
        return None

    def reader_processes(self, num_workers: int | str) -> int:
        """The processes that decode this source into the RAM cache
        (:func:`~vitflow.data.cache.cache_in_memory`) for ``data.num_workers``: one per core for
        the sources vitflow reads itself (a user's dataset: ``pyobjects.DatasetSource``)."""
        return os.cpu_count() or 1


class FileSource(ImageSource):
    """Encoded image files read through a :class:`~vitflow.data.sources.readers.FolderReader` (``keys``
    are paths relative to the root) or a :class:`~vitflow.data.sources.readers.TarReader` (``keys`` are
    member names, ``spans`` their ``(offset, size)``). ``keys`` hold the names' bytes
    (``os.fsencode``: any file name, UTF-8 or not)."""

    def __init__(self, classes: list[str], labels: np.ndarray, reader,
                 keys: np.ndarray, spans: np.ndarray | None = None):
        self.classes, self.labels, self.reader, self.keys, self.spans = classes, labels, reader, keys, spans

    def name(self, i: int) -> str:
        return self.reader.describe(os.fsdecode(self.keys[i]))

    def read(self, i: int) -> bytes:
        """The encoded bytes of image ``i``. Raises CorruptImageError when unreadable."""
        try:
            if self.spans is not None:
                return self.reader.read((int(self.spans[i, 0]), int(self.spans[i, 1])))
            return self.reader.read(os.fsdecode(self.keys[i]))
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


def sample_indices(labels: np.ndarray, n: int = 10) -> list[int]:
    """Up to ``n`` indices of ``labels`` (``int64 (N,)`` class indices, or multi-hot rows): the first
    image of each class (in the order the classes first appear), then the next images in order."""
    keys = labels.argmax(1) if labels.ndim == 2 else labels
    firsts = sorted(np.unique(keys, return_index=True)[1].tolist())[:n]
    taken = set(firsts)
    return firsts + [i for i in range(min(len(keys), 2 * n)) if i not in taken][:n - len(firsts)]


def export_samples(source: ImageSource, folder: str | Path, n: int = 10) -> list[Path]:
    """Write up to ``n`` readable images of ``source`` (one per class first: :func:`sample_indices`)
    into ``folder`` as ``NN_<class>.EXT`` (``NN`` is the index in ``source``, zero-padded): a file's own bytes
    when the images are files (a :class:`FileSource`, also behind a RAM cache's ``base``), else a
    PNG of the decoded image. For ``vitflow predict``, the report's attention maps and sample panel.
    Returns the paths."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = getattr(source, "base", None)
    files = files if isinstance(files, FileSource) and len(files) == len(source) else source
    paths: list[Path] = []
    width = max(2, len(str(len(source) - 1)))  # the names sort in index order
    for i in sample_indices(np.asarray(source.labels), 4 * n):
        if len(paths) == n:
            break
        label = source.labels[i]
        name = f"{i:0{width}d}_{source.classes[int(label.argmax() if np.ndim(label) else label)]}"
        try:
            if isinstance(files, FileSource):
                suffix = Path(os.fsdecode(files.keys[i])).suffix.lower() or ".jpg"
                (path := folder / f"{name}{suffix}").write_bytes(files.read(i))
            else:
                path = folder / f"{name}.png"
                Image.fromarray(source.load(i).permute(1, 2, 0).numpy()).save(path)
        except CorruptImageError:
            continue  # reported by the passes over the split
        paths.append(path)
    return paths
