"""``vitflow prepare SRC OUT --format wds --shard-size N``: WebDataset shards from any source vitflow
reads (image folder, tar, label file, Hugging Face dataset, packed dataset, CIFAR batches, shards).

Each split becomes ``OUT/<split>-NNNNNN.tar`` holding ``N`` samples a shard (the last fewer):
``KKKKKKKK.<jpg|png|webp>`` (the image's bytes as stored; other formats and decoded-pixel
sources re-encoded as PNG) and ``KKKKKKKK.cls`` (the class index as text), where the key is the
sample's number in the split. The training split is written in a random order (a fixed seed: the
same shards each time), as WebDataset advises: a folder's order is class by class, and shards of
one class each would leave training's per-epoch shard shuffle and shuffle buffer to mix classes
that only meet when the buffer spans shards. Other splits keep the split's order. Beside them
``classes.txt`` and ``shards.json`` (the sample count of every shard, wids index format). Written
to ``OUT.partial`` and renamed when complete; an existing non-empty ``OUT`` is replaced only with
``--force`` and only when it holds nothing but shards and their index (what this module writes).
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np

from vitflow.data.decode import CorruptImageError, image_size
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.wds.index import read_index, write_index
from vitflow.data.wds.shards import INDEX_NAME

log = logging.getLogger(__name__)
_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"))
SHUFFLE_SEED = 0  # the training split's write order


def image_member(source: ImageSource, i: int) -> tuple[bytes, str]:
    """``(bytes, extension)`` of image ``i`` as a shard member: its own JPEG / PNG / WebP bytes,
    else a PNG of its pixels.

    Raises:
        CorruptImageError: unreadable image (its header, or its pixels).
    """
    data = source.encoded(i)
    if data is not None:
        image_size(data, source.name(i))  # a damaged file is skipped here, not copied
        ext = next((e for magic, e in _MAGIC if data.startswith(magic)), None)
        if ext is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            ext = "webp"
        if ext is not None:
            return data, ext
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(source.load(i).permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return buf.getvalue(), "png"


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))


def write_split_shards(source: ImageSource, folder: Path, split: str, shard_size: int,
                       seed: int | None = None) -> tuple[dict[str, int], int]:
    """Write ``source`` as ``folder/<split>-NNNNNN.tar`` shards of ``shard_size`` samples, in the
    source's order or, with ``seed``, in a random permutation drawn from it.
    Returns ``({shard file name: samples}, images skipped as unreadable)``."""
    counts: dict[str, int] = {}
    skipped, tf, name = 0, None, ""
    labels = np.asarray(source.labels)
    order = range(len(source)) if seed is None else np.random.default_rng(seed).permutation(len(source))
    for i in map(int, order):
        try:
            data, ext = image_member(source, i)
        except CorruptImageError as e:
            skipped += 1
            log.warning("skipped unreadable image %s: %s", e.path, e.reason)
            continue
        if tf is None or counts[name] == shard_size:
            if tf is not None:
                tf.close()
            name = f"{split}-{len(counts):06d}.tar"
            tf, counts[name] = tarfile.open(folder / name, "w", format=tarfile.GNU_FORMAT), 0
        key = f"{i:08d}"
        _add(tf, f"{key}.{ext}", data)
        _add(tf, f"{key}.cls", str(int(labels[i])).encode())
        counts[name] += 1
    if tf is not None:
        tf.close()
    return counts, skipped


def is_shard_folder(folder: Path) -> bool:
    """True when ``folder`` holds nothing but a ``shards.json`` index, ``classes.txt`` and the
    shards the index lists (what :func:`prepare_shards` writes)."""
    try:
        listed = set(read_index(str(folder / INDEX_NAME))[0])
        names = {p.name for p in folder.iterdir()}
    except (DataError, OSError):
        return False
    return INDEX_NAME in names and names <= listed | {INDEX_NAME, "classes.txt"}


def prepare_shards(splits: dict[str, ImageSource], out: str | Path, shard_size: int, source: str = "",
                   force: bool = False) -> dict:
    """Write every split of ``splits`` as shards in ``out`` (see the module docstring); with
    ``force``, shards written before at ``out`` (:func:`is_shard_folder`) are replaced.

    Returns:
        ``{"format": "wds", "classes", "splits": {name: {"count", "shards", "skipped"}}}``.
    Raises:
        DataError: ``out`` exists and is not an empty folder (with ``force``: and not a shard
            folder); ``shard_size`` < 1; a multi-label source.
    """
    out = Path(out)
    if shard_size < 1:
        raise DataError(f"--shard-size {shard_size}: give at least 1 sample a shard")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise DataError(f"{out} exists and is not empty; pass --force to replace shards written there before")
        if not is_shard_folder(out):
            raise DataError(f"{out} exists and is not a folder of shards with their shards.json; refusing to "
                            "replace it")
    if any(np.asarray(s.labels).ndim != 1 for s in splits.values()):
        raise DataError("shards hold one class a sample (.cls); the source is multi-label")
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    counts: dict[str, int] = {}
    meta = {"format": "wds", "source": str(source), "classes": splits["train"].classes, "splits": {}}
    for name, src in splits.items():
        c, skipped = write_split_shards(src, partial, name, shard_size, SHUFFLE_SEED if name == "train" else None)
        counts.update(c)
        meta["splits"][name] = {"count": sum(c.values()), "shards": len(c), "skipped": skipped, "kind": "wds"}
    write_index(str(partial), counts, list(meta["classes"]), {k: os.path.getsize(partial / k) for k in counts},
                out.name)
    if out.exists():
        shutil.rmtree(out)  # empty, or (force) a shard folder: checked above
    partial.rename(out)
    return meta
