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

import io
import json
import logging
import multiprocessing as mp
import pickle
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.sources import DataError, ImageSource, TensorSource
from vitflow.runtime import quiet

log = logging.getLogger(__name__)

FORMAT = "vitflow-packed"
VERSION = 1
SPLIT_NAMES = ("train", "test", "val", "validation")


def is_packed(path: str | Path) -> bool:
    """True when ``path`` is a folder holding a vitflow packed dataset."""
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


class PackedSource(ImageSource):
    """One split of a packed dataset, memory-mapped; ``rows`` selects images of the split."""

    def __init__(self, root: Path, split: str, classes: list[str], info: dict, rows: np.ndarray | None = None):
        self.root, self.split, self.classes, self.info = root, split, classes, info
        folder = root / split
        labels = np.load(folder / "labels.npy", mmap_mode="r")
        self.rows = np.arange(len(labels)) if rows is None else rows
        self.labels = np.asarray(labels[self.rows], dtype=np.int64)
        self._names = np.load(folder / "names.npy", mmap_mode="r")
        if info["kind"] == "raw":
            c, h, w = info["shape"]
            self._images = np.memmap(folder / "images.u8", np.uint8, "r", shape=(info["count"], c, h, w))
            self.fixed_size = (h, w)
        else:
            self._data = np.memmap(folder / "data.bin", np.uint8, "r")
            self._offsets = np.load(folder / "offsets.npy")
            self.fixed_size = None

    def name(self, i: int) -> str:
        return f"{self.root}/{self.split}#{self.rows[i]} ({self._names[self.rows[i]].decode()})"

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


def open_packed(path: str | Path, split: str) -> PackedSource:
    """Open split ``split`` of the packed dataset at ``path``.

    Raises:
        DataError: not a packed dataset, or no such split (the message lists the splits).
    """
    root = Path(path)
    meta = json.loads((root / "meta.json").read_text())
    if meta.get("version") != VERSION:
        raise DataError(f"{root}: packed format version {meta.get('version')} is not supported (want {VERSION})")
    if split not in meta["splits"]:
        raise DataError(f"split {split!r} not in packed dataset {root}; it has: {', '.join(meta['splits'])}")
    return PackedSource(root, split, meta["classes"], meta["splits"][split])


# ---------------------------------------------------------------------------------------------
# CIFAR python batches (https://www.cs.toronto.edu/~kriz/cifar.html)


def is_cifar_batches(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "batches.meta").is_file() or ((p / "meta").is_file() and (p / "train").is_file()))


def cifar_batches_source(path: str | Path, split: str) -> TensorSource:
    """CIFAR-10 (``data_batch_1..5``, ``test_batch``, ``batches.meta``) or CIFAR-100 (``train``,
    ``test``, ``meta``; fine labels) python batches as an in-memory ``uint8`` source.

    These files are Python pickles, the dataset's official format: open only copies you trust.

    Raises:
        DataError: unknown split or unreadable batch file.
    """
    root = Path(path)
    cifar10 = (root / "batches.meta").is_file()
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]} if cifar10 else \
        {"train": ["train"], "test": ["test"]}
    if split not in files:
        raise DataError(f"CIFAR batches in {root} have splits 'train' and 'test', not {split!r}")

    def load(name: str) -> dict:
        try:
            with open(root / name, "rb") as f:
                return pickle.load(f, encoding="bytes")
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise DataError(f"cannot read CIFAR batch {root / name}: {e}") from None

    meta = load("batches.meta" if cifar10 else "meta")
    classes = [c.decode() for c in meta[b"label_names" if cifar10 else b"fine_label_names"]]
    parts = [load(f) for f in files[split]]
    data = np.concatenate([p[b"data"] for p in parts]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([p[b"labels" if cifar10 else b"fine_labels"] for p in parts]).astype(np.int64)
    return TensorSource(classes, labels, torch.from_numpy(np.ascontiguousarray(data)), f"{root}/{split}")


# ---------------------------------------------------------------------------------------------
# prepare


def _encode_one(source: ImageSource, i: int, kind: str, max_side: int | None, quality: int):
    """Worker: image ``i`` -> raw uint8 array or JPEG bytes; ``(i, payload | None, why unreadable)``."""
    try:
        img = source.load(i)
    except CorruptImageError as e:
        return i, None, e.reason
    if kind == "raw":
        return i, img.numpy(), None
    return i, encode_jpeg(fit_max_side(img, max_side), quality), None


def fit_max_side(img: torch.Tensor, max_side: int | None) -> torch.Tensor:
    """Downscale ``uint8 (3, H, W)`` (antialiased bilinear) so that ``max(H, W) <= max_side``."""
    h, w = img.shape[-2:]
    if not max_side or max(h, w) <= max_side:
        return img
    from torchvision.transforms.v2 import functional as F

    scale = max_side / max(h, w)
    return F.resize(img, [max(1, round(h * scale)), max(1, round(w * scale))], antialias=True)


def encode_jpeg(img: torch.Tensor, quality: int) -> bytes:
    """``uint8 (3, H, W)`` -> baseline JPEG bytes (Pillow / libjpeg-turbo)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_WORKER_SOURCE: ImageSource | None = None


def _init_worker(source: ImageSource) -> None:
    global _WORKER_SOURCE
    _WORKER_SOURCE = source
    torch.set_num_threads(1)


def _work(args):
    return _encode_one(_WORKER_SOURCE, *args)


def encode_images(source: ImageSource, kind: str, max_side: int | None, quality: int, workers: int,
                  desc: str) -> Iterator[tuple[int, object, str | None]]:
    """Decode every image of ``source`` (``kind="raw"``: ``uint8 (3, H, W)`` arrays) or also
    re-encode it (``"jpeg"``: bytes at ``quality``, longer side <= ``max_side``) with ``workers``
    processes and a progress bar; yields ``(index, payload or None, why the image is unreadable
    or None)`` in index order."""
    jobs = [(i, kind, max_side, quality) for i in range(len(source))]
    bar = dict(total=len(jobs), desc=desc, unit="img", mininterval=1.0, disable=quiet())
    with logging_redirect_tqdm():  # warnings about bad images print above the bar, not into it
        if workers <= 1:
            yield from tqdm((_encode_one(source, *j) for j in jobs), **bar)
            return
        with mp.get_context("fork").Pool(workers, _init_worker, (source,)) as pool:
            yield from tqdm(pool.imap(_work, jobs, chunksize=64), **bar)


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
            names.append(source.name(i).encode())
    np.save(folder / "labels.npy", np.array(labels, dtype=np.int64))
    np.save(folder / "names.npy", np.array(names, dtype="S"))
    info: dict = {"kind": kind, "count": len(labels), "skipped": len(skipped)}
    if kind == "raw":
        info["shape"] = shape or [3, 0, 0]
    else:
        np.save(folder / "offsets.npy", np.array(offsets, dtype=np.int64))
        info.update(max_side=max_side, quality=quality)
    return info


def _splits_of(src: Path) -> dict[str, ImageSource]:
    from vitflow.data.sources import open_split

    if is_cifar_batches(src):
        return {s: cifar_batches_source(src, s) for s in ("train", "test")}
    found: dict[str, ImageSource] = {}
    train = open_split(src, "train", label="SRC")
    found["train"] = train
    for name in SPLIT_NAMES[1:]:
        try:
            found[name] = open_split(src, name, classes=train.classes, label="SRC")
        except DataError as e:
            if "not found" not in str(e):
                raise
    return found


def prepare(src: str | Path, out: str | Path, fmt: str = "auto", max_side: int | None = None, quality: int = 90,
            workers: int = 1, force: bool = False) -> dict:
    """Convert an image folder, a tar, or CIFAR-10/100 python batches into a packed dataset.

    Args:
        fmt: ``raw`` (uint8 pixels; every image the same size), ``jpeg`` (re-encoded at
            ``quality``, longer side capped at ``max_side``), or ``auto`` (raw when every image of
            the first 256 is the same size and at most 64 px, else jpeg).
        workers: decode/encode processes.
        force: replace an existing packed dataset at ``out``.
    Returns:
        The ``meta.json`` contents.
    Raises:
        DataError: ``out`` exists (without ``force``, or not a packed dataset), unreadable source,
        mixed sizes for raw.
    """
    src, out = Path(src), Path(out)
    if out.exists():
        if not force:
            raise DataError(f"{out} exists; pass --force to replace it")
        if not is_packed(out):
            raise DataError(f"{out} exists and is not a vitflow packed dataset; refusing to replace it")
    splits = _splits_of(src)
    if fmt == "auto":
        probe = splits["train"]
        sizes = set()
        for i in range(min(256, len(probe))):
            try:
                sizes.add(tuple(probe.load(i).shape[-2:]))
            except CorruptImageError:
                continue  # skipped (and counted) when the split is written
        fmt = "raw" if len(sizes) == 1 and max(next(iter(sizes))) <= 64 else "jpeg"
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    meta = {"format": FORMAT, "version": VERSION, "source": str(src), "classes": splits["train"].classes,
            "splits": {}}
    for name, source in splits.items():
        meta["splits"][name] = write_split(source, partial / name, fmt, max_side, quality, workers,
                                            f"prepare {name}")
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return meta
