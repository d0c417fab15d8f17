"""The packed dataset format and ``vitflow prepare``.

A packed dataset is a folder that is memory-mapped at read time, with no per-image file open::

    OUT/meta.json                {"format": "vitflow-packed", "version": 1, "classes": [...],
                                  "splits": {"train": {...}, "test": {...}}}
    OUT/<split>/labels.npy       int64 (n,)
    OUT/<split>/names.npy        bytes (n,): where each image came from (for messages)
    raw  (small fixed-size images, e.g. CIFAR):
    OUT/<split>/images.u8        uint8 (n, 3, H, W), C order
    jpeg (large images):
    OUT/<split>/data.bin         the JPEG files back to back (EXIF orientation already applied)
    OUT/<split>/offsets.npy      int64 (n + 1,): image i is data.bin[offsets[i]:offsets[i+1]]

Each split's entry in ``meta.json`` holds ``kind`` ("raw" | "jpeg"), ``count``, and ``shape``
(raw) or ``max_side`` / ``quality`` (jpeg). A dataset is written to ``OUT.partial`` and renamed
when complete, so an interrupted ``prepare`` never leaves a half dataset under ``OUT``.
Unreadable source images are skipped and named in a warning (the same policy as training).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.encode import encode_images
from vitflow.data.remote.fs import RangeArray, RemoteError, is_remote, join, load_npy, read_bytes
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.kind import SourceKind, relabel

log = logging.getLogger(__name__)

FORMAT = "vitflow-packed"
VERSION = 1
SPLIT_NAMES = ("train", "val", "valid", "validation", "test")


def is_packed(path: str | Path) -> bool:
    """True when ``path`` is a folder (or a URL, see :mod:`vitflow.data.remote.fs`) holding a vitflow
    packed dataset. Raises RemoteError for a URL that stays unreachable."""
    if is_remote(path):
        try:
            return json.loads(read_bytes(join(path, "meta.json"))).get("format") == FORMAT
        except RemoteError as e:
            if e.status == 404:
                return False
            raise
        except ValueError:
            return False
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


class PackedSource(ImageSource):
    """One split of a packed dataset, memory-mapped (a remote one, at a URL, read by range
    requests: :class:`~vitflow.data.remote.fs.RangeArray`); ``rows`` selects images of the split."""

    def __init__(self, root: Path | str, split: str, classes: list[str], info: dict, rows: np.ndarray | None = None):
        self.root, self.split, self.classes, self.info = root, split, classes, info
        folder = join(root, split)
        labels = load_npy(join(folder, "labels.npy"))
        self.rows = np.arange(len(labels)) if rows is None else rows
        self.labels = np.asarray(labels[self.rows], dtype=np.int64)
        self._names = load_npy(join(folder, "names.npy"))
        remote = is_remote(root)
        if info["kind"] == "raw":
            c, h, w = info["shape"]
            shape, images = (info["count"], c, h, w), join(folder, "images.u8")
            self._images = RangeArray(images, shape) if remote else np.memmap(images, np.uint8, "r", shape=shape)
            self.fixed_size = (h, w)
        else:
            self._offsets = np.array(load_npy(join(folder, "offsets.npy")))
            data = join(folder, "data.bin")
            self._data = RangeArray(data, (int(self._offsets[-1]),)) if remote else np.memmap(data, np.uint8, "r")
            self.fixed_size = None

    def name(self, i: int) -> str:
        return f"{self.root}/{self.split}#{self.rows[i]} ({self._names[self.rows[i]].decode(errors='replace')})"

    def load(self, i: int) -> torch.Tensor:
        if self.fixed_size is not None:
            return torch.from_numpy(np.array(self._images[self.rows[i]]))
        return decode_image(self.encoded(i), self.name(i))

    def encoded(self, i: int) -> bytes | None:
        if self.fixed_size is not None:
            return None
        r = self.rows[i]
        return self._data[self._offsets[r]:self._offsets[r + 1]].tobytes()

    def load_batch(self, idx: np.ndarray) -> torch.Tensor:
        if self.fixed_size is None:
            return super().load_batch(idx)
        rows = self.rows[np.asarray(idx)]
        return torch.from_numpy(self._images[rows])  # NumPy fancy indexing copies into one array

    def subset(self, idx: np.ndarray) -> "PackedSource":
        return PackedSource(self.root, self.split, self.classes, self.info, self.rows[np.asarray(idx)])


def packed_split_names(path: str | Path) -> list[str]:
    """The splits of the packed dataset at ``path`` (a folder or a URL)."""
    return list(json.loads(read_bytes(join(path, "meta.json")))["splits"])


def open_packed(path: str | Path, split: str) -> PackedSource:
    """Open split ``split`` of the packed dataset at ``path``.

    Raises:
        DataError: not a packed dataset, or no such split (the message lists the splits).
    """
    root = path if is_remote(path) else Path(path)
    meta = json.loads(read_bytes(join(root, "meta.json")))
    if meta.get("version") != VERSION:
        raise DataError(f"{root}: packed format version {meta.get('version')} is not supported (want {VERSION})")
    if split not in meta["splits"]:
        raise DataError(f"split {split!r} not in packed dataset {root}; it has: {', '.join(meta['splits'])}")
    return PackedSource(root, split, meta["classes"], meta["splits"][split])


def common_size(source: ImageSource, probe: int = 256) -> tuple[int, int] | None:
    """The ``(H, W)`` (pixels, as decoded: EXIF orientation applied) that the first ``probe``
    images of ``source`` share, what raw packing needs; ``None`` when they differ or none of them
    is readable (unreadable images are left out)."""
    if source.fixed_size is not None:
        return tuple(source.fixed_size)
    sizes: set[tuple[int, int]] = set()
    for i in range(min(probe, len(source))):
        try:
            sizes.add(tuple(source.load(i).shape[-2:]))
        except CorruptImageError:
            continue  # skipped (and counted) when the split is written
        if len(sizes) > 1:
            return None
    return next(iter(sizes), None)


def write_split(source: ImageSource, folder: Path, kind: str, max_side: int | None, quality: int,
                workers: int, desc: str) -> dict:
    """Write ``source`` as one packed split in ``folder`` (created); returns its ``meta.json`` entry.

    Raises:
        DataError: raw packing of images of different sizes.
    """
    folder.mkdir(parents=True)
    labels, names, skipped, shape = [], [], [], None
    offsets = [0]
    with open(folder / ("images.u8" if kind == "raw" else "data.bin"), "wb") as out:
        for i, payload, err in encode_images(source, kind, max_side, quality, workers, desc):
            if payload is None:
                skipped.append(err)
                log.warning("prepare: skipped unreadable image %s: %s", source.name(i), err)
                continue
            if kind == "raw":
                if shape is None:
                    shape = list(payload.shape)
                elif list(payload.shape) != shape:
                    raise DataError(f"{source.name(i)} is {tuple(payload.shape[1:])}, not {tuple(shape[1:])}: "
                                    "raw packing needs one image size; use --format jpeg")
                out.write(np.ascontiguousarray(payload).tobytes())
            else:
                out.write(payload)
                offsets.append(offsets[-1] + len(payload))
            labels.append(int(source.labels[i]))
            names.append(source.name(i).encode(errors="backslashreplace"))
    np.save(folder / "labels.npy", np.array(labels, dtype=np.int64))
    np.save(folder / "names.npy", np.array(names, dtype="S"))
    info: dict = {"kind": kind, "count": len(labels), "skipped": len(skipped)}
    if kind == "raw":
        info["shape"] = shape or [3, 0, 0]
    else:
        np.save(folder / "offsets.npy", np.array(offsets, dtype=np.int64))
        info.update(max_side=max_side, quality=quality)
    return info


KIND = SourceKind("packed", "a packed dataset (vitflow prepare)", lambda where, cfg: packed_split_names(where),
                  lambda where, split, classes, cfg: relabel(open_packed(where, split), classes),
                  detect=is_packed, what="vitflow packed dataset", remote=is_packed, remote_probes=True)
