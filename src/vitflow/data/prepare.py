"""``vitflow prepare``: convert an image folder, a tar or CIFAR batches into a packed dataset
(:mod:`vitflow.data.sources.packed`), every split it finds, written to ``OUT.partial`` and renamed when
complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.dispatch import open_split, split_names
from vitflow.data.sources.labels import canonical_split
from vitflow.data.sources.packed import FORMAT, VERSION, common_size, is_packed, write_split
from vitflow.data.wds.prepare import prepare_shards


def _splits_of(src: str | Path) -> dict[str, ImageSource]:
    """The train split of ``src`` and its val and test splits where it has them (val also finds a
    valid/ or validation/ split, written as val)."""
    train = open_split(src, "train", label="SRC")
    found: dict[str, ImageSource] = {"train": train}
    names = split_names(src, label="SRC")
    for name in ("val", "test"):
        if canonical_split(name, names) is not None:
            found[name] = open_split(src, name, classes=train.classes, label="SRC")
    return found


def prepare(src: str | Path, out: str | Path, fmt: str = "auto", max_side: int | None = None, quality: int = 90,
            workers: int = 1, force: bool = False, shard_size: int | None = None) -> dict:
    """Convert an image folder, a tar, a (single-label) label file, a Hugging Face dataset or
    CIFAR-10/100 python batches into a packed dataset.

    Args:
        fmt: ``raw`` (uint8 pixels; every image the same size), ``jpeg`` (re-encoded at
            ``quality``, longer side capped at ``max_side``), or ``auto`` (raw when every image of
            the first 256 is the same size and at most 64 px, else jpeg); ``wds``: WebDataset shards of
            ``shard_size`` samples (default 1000) instead (:mod:`vitflow.data.wds.prepare`).
        workers: decode/encode processes.
        force: replace an existing packed dataset (``wds``: shard folder) at ``out``.
    Returns:
        The ``meta.json`` contents.
    Raises:
        DataError: ``out`` exists (without ``force``, or not a packed dataset / shard folder),
        unreadable source, mixed sizes for raw, ``shard_size`` given for another format than ``wds``.
    """
    if fmt == "wds":  # WebDataset shards (data/wds/prepare.py)
        return prepare_shards(_splits_of(src), out, 1000 if shard_size is None else shard_size, str(src), force)
    if shard_size is not None:
        raise DataError(f"--shard-size {shard_size} applies to --format wds only (the format is {fmt})")
    src, out = Path(src), Path(out)
    if out.exists():
        if not force:
            raise DataError(f"{out} exists; pass --force to replace it")
        if not is_packed(out):
            raise DataError(f"{out} exists and is not a vitflow packed dataset; refusing to replace it")
    splits = _splits_of(src)
    if fmt == "auto":
        size = common_size(splits["train"])
        fmt = "raw" if size is not None and max(size) <= 64 else "jpeg"
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
