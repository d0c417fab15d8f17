"""Where a split's shards are, how ``auto`` tells a shard set from the other kinds, and
:class:`ShardSource`, the random-access view of a split's shards (validation and test splits,
``vitflow prepare`` and ``vitflow bench data`` read through it; training streams, see
:mod:`vitflow.data.wds.stream`).

Detection (``data.source=auto``), checked before the other kinds: ``data.path`` is a shard set
when it holds a brace pattern, a ``::`` list or a ``*`` glob naming ``.tar`` files; or is a
remote ``.tar`` URL; or is a folder holding ``shards.json``, or ``.tar`` files whose first is a
WebDataset shard; or is one ``.tar`` that is a WebDataset shard. A tar is a WebDataset shard when
among its first 16 members an image and a label (``.cls``/``.json``/``.txt``) share a key; a tar
of class folders (the ``tar`` kind) never has label members, so the two kinds do not overlap.

Splits: a pattern or list in ``data.path`` is the ``train`` split. A folder's ``.tar`` files are
grouped by the split name they carry as a ``-``/``_``/``.``-separated token
(``train-000000.tar``, ``imagenet1k-validation-0003.tar``, ``test_00.tar``; ``val`` also finds
``valid``/``validation``), or by a sub-folder named after the split (``train/000000.tar``);
when no file names a split, all of them are ``train``. ``data.train_split`` / ``data.val_split``
/ ``data.test_split`` may also be a shard pattern themselves (``val-{000..007}.tar``, relative to
the folder of ``data.path``), as timm's ``--train-split`` takes one.
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.remote.fs import expand_urls, is_remote, open_stream
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.labels import canonical_split
from vitflow.data.sources.splits import parse_split
from vitflow.data.wds.index import read_classes, read_index, shard_set
from vitflow.data.wds.shards import (
    INDEX_NAME,
    beside,
    has_pattern,
    is_compressed,
    iter_samples,
    looks_like_shard,
    parse_label,
    read_range,
    truncated,
)

log = logging.getLogger(__name__)
SPLIT_TOKENS = ("train", "val", "valid", "validation", "test")
_TAR = (".tar", ".tar.gz", ".tgz")


def is_shard_pattern(text: str) -> bool:
    """True when a split key or path is itself a list of shards (a pattern or a ``.tar`` name)."""
    return has_pattern(text) or text.endswith(_TAR)


def _tars(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if f.endswith(_TAR) and not f.startswith(".") and os.path.isfile(os.path.join(folder, f)))


def is_wds(path: str) -> bool:
    """True when ``path`` is a WebDataset shard set (see the module docstring)."""
    if has_pattern(path):
        return True
    if is_remote(path):  # a remote .tar of WebDataset members (else a tar read in place: data/sources/remote.py)
        return path.endswith(_TAR) and looks_like_shard(path)
    p = os.path.expanduser(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, INDEX_NAME)):
            return True
        tars = _tars(p)
        return bool(tars) and looks_like_shard(tars[0])
    return p.endswith(_TAR) and os.path.isfile(p) and looks_like_shard(p)


def _split_of(name: str) -> str | None:
    tokens = re.split(r"[-_.]", name.split(".tar")[0])
    return next((t for t in tokens if t in SPLIT_TOKENS), None)


def folder_splits(folder: str) -> dict[str, list[str]]:
    """``{split: [shard paths]}`` of a shard folder (see the module docstring)."""
    found: dict[str, list[str]] = {}
    for t in _tars(folder):
        found.setdefault(_split_of(os.path.basename(t)) or "", []).append(t)
    for sub in SPLIT_TOKENS:
        if os.path.isdir(os.path.join(folder, sub)):
            found.setdefault(sub, []).extend(_tars(os.path.join(folder, sub)))
    if set(found) == {""}:
        return {"train": found[""]}
    found.pop("", None)
    return {k: v for k, v in found.items() if v}


def wds_split_names(path: str) -> list[str]:
    """The splits of the shard set ``path``."""
    p = os.path.expanduser(path)
    return list(folder_splits(p)) if not has_pattern(path) and os.path.isdir(p) else ["train"]


def split_urls(path: str, split: str, key: str | None = None) -> list[str]:
    """The shard URLs of ``split`` (a split name or a shard pattern) of the shard set ``path``;
    ``key``: the config key of a pattern, named by its errors (``None``: the caller names it).

    Raises:
        DataError: a pattern matching nothing, or a split the shard set does not have
            (``... not found``, listing the splits it has).
    """
    if is_shard_pattern(split):
        first = path.split("::")[0]
        base = first if os.path.isdir(os.path.expanduser(first)) else first.rsplit("/", 1)[0] if "/" in first else "."
        parts = [s if s.startswith("/") or "://" in s else base.rstrip("/") + "/" + s for s in split.split("::")]
        return expand_urls("::".join(parts), key)
    p = os.path.expanduser(path)
    if has_pattern(path) or not os.path.isdir(p):
        if split == "train":
            return expand_urls(path)
        raise DataError(f"split {split!r} not found: data.path={path} names the training shards; give the "
                        f"{split} shards as a pattern, e.g. data.val_split='{split}-{{000000..000007}}.tar'")
    splits = folder_splits(p)
    if split not in splits:
        raise DataError(f"split {split!r} not found in the shard folder {path} (splits: {', '.join(splits)})")
    return splits[split]


class ShardSource(ImageSource):
    """The samples of a list of shards, by random access: image member ``i`` is read from
    ``urls[shard[i]]`` at ``spans[i] = (offset, size)`` (``os.pread``; a range read of a remote
    shard), in shard order.

    Built by one pass over the shards reading their headers and labels (image bytes skipped).
    A sample that cannot be evaluated stays in and raises :class:`CorruptImageError` naming it
    when loaded, as an unreadable image file does (so an evaluation skips and counts it): one
    without a label or an image, one cut by the end of a truncated shard, and each sample the
    index (``shards.json``) counts after the end of a shard that holds fewer (``shard.tar:#k``).
    Their label is ``0`` (never used: they are never loaded).
    """

    def __init__(self, classes: list[str], labels: np.ndarray, urls: list[str], shard: np.ndarray,
                 spans: np.ndarray, keys: np.ndarray, errors: dict[int, str] | None = None):
        self.classes, self.labels, self.urls = classes, labels, urls
        self.shard, self.spans, self.keys = shard, spans, keys
        self.errors = errors or {}
        self._fds: dict[int, int] = {}
        self._pid = -1

    def name(self, i: int) -> str:
        return f"{self.urls[int(self.shard[i])]}:{self.keys[i].decode('utf-8', 'backslashreplace')}"

    def encoded(self, i: int) -> bytes:
        s = int(self.shard[i])
        if i in self.errors:
            raise CorruptImageError(self.name(i), self.errors[i])
        offset, size = int(self.spans[i, 0]), int(self.spans[i, 1])
        if is_remote(self.urls[s]):
            data = read_range(self.urls[s], offset, size)
        else:
            if self._pid != os.getpid():
                self._fds, self._pid = {}, os.getpid()
            try:
                if s not in self._fds:
                    self._fds[s] = os.open(self.urls[s], os.O_RDONLY)
                data = os.pread(self._fds[s], size, offset)
            except OSError as e:
                raise CorruptImageError(self.name(i), f"cannot read: {e}") from None
        if len(data) != size:
            raise CorruptImageError(self.name(i), f"the shard ends inside this image ({len(data)} of {size} bytes)")
        return data

    def load(self, i: int) -> torch.Tensor:
        return decode_image(self.encoded(i), self.name(i))

    def subset(self, idx: np.ndarray) -> "ShardSource":
        idx = np.asarray(idx, dtype=np.int64)
        errors = {int(j): self.errors[int(i)] for j, i in enumerate(idx) if int(i) in self.errors}
        return ShardSource(self.classes, self.labels[idx], self.urls, self.shard[idx], self.spans[idx],
                           self.keys[idx], errors)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fds": {}, "_pid": -1}


def open_shard_source(urls: list[str], classes: list[str] | None = None,
                      classes_file: str | None = None) -> ShardSource:
    """A :class:`ShardSource` over ``urls`` (uncompressed shards), labelled with ``classes`` (default:
    the shard set's class list).

    Raises:
        DataError: compressed shards, no class list, no samples.
    """
    if any(is_compressed(u) for u in urls):
        raise DataError(f"{urls[0]}: validation and test shards are read by offset and must be uncompressed tars")
    classes = classes or read_classes(urls[0], classes_file) or shard_set(urls, classes_file).classes
    indexed: dict[str, int] = {}
    for first in {beside(u, ""): u for u in urls}.values():  # the index of each folder, if any
        indexed.update(read_index(first)[0])
    labels, shard, spans, keys, errors = [], [], [], [], {}

    def add(s: int, key: str, label: int, span: tuple[int, int], error: str | None) -> None:
        if error is not None:
            errors[len(labels)] = error
        labels.append(label)
        shard.append(s)
        spans.append(span)
        keys.append(key.encode("utf-8", "surrogateescape"))

    for s, url in enumerate(urls):
        n = cut = 0
        with open_stream(url) as f:
            for sample in iter_samples(url, f, read_images=False):
                ext, label, n, cut = sample.image_ext(), 0, n + 1, int(sample.error is not None)
                try:
                    if ext is None:
                        raise ValueError("no image member (.jpg, .jpeg, .png or .webp)")
                    label = parse_label(sample, classes)
                except ValueError as e:
                    sample.error = sample.error or str(e)
                add(s, sample.key, label, sample.members.get(ext, (0, 0)), sample.error)
        count = indexed.get(os.path.basename(url), n)
        if n < count:  # truncated: the samples the index promised after the end are counted, as training counts them
            why = truncated(url, n - cut, count, bool(cut))
            for k in range(n, count):
                add(s, f"#{k}", 0, (0, 0), f"missing: {why}")
    if len(errors) == len(labels):
        raise DataError(f"{urls[0]}: no samples (image + label members) in {len(urls)} shard(s)")
    return ShardSource(list(classes), np.asarray(labels, dtype=np.int64), urls, np.asarray(shard, dtype=np.int32),
                       np.asarray(spans, dtype=np.int64).reshape(-1, 2), np.array(keys), errors)


def open_wds_split(path: str, split: str, classes: list[str] | None = None,
                   classes_file: str | None = None) -> ShardSource:
    """One split of the shard set ``path`` as a :class:`ShardSource`: ``split`` is a shard
    pattern, or a split expression (``val``, ``train[90%:]``; ``val`` also finds ``valid`` /
    ``validation``; a slice selects as :class:`~vitflow.data.sources.splits.Split` does).

    Raises:
        DataError: see :func:`split_urls` and :func:`open_shard_source`.
    """
    if is_shard_pattern(split):
        return open_shard_source(split_urls(path, split), classes, classes_file)
    sp = parse_split(split)
    name = sp.name
    if name in ("val", "valid", "validation"):
        name = canonical_split(name, wds_split_names(path)) or name
    src = open_shard_source(split_urls(path, name), classes, classes_file)
    return src.subset(sp.select(len(src))) if sp.sliced else src
