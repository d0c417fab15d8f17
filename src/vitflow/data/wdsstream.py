"""Training from WebDataset shards: each rank streams its part of the epoch's shards once,
sequentially, through a shuffle buffer, and its loader workers decode and augment whole batches.

The epoch order is a function of ``(seed, epoch, world_size, batch size)`` only, never of the
number of loader workers, so a run resumed at ``(epoch, batch)`` sees exactly the batches an
uninterrupted run would have seen:

1. **Shards**: permuted from ``(seed, epoch)``; their samples (the counts from the index) laid
   end to end make the epoch's stream of ``N`` samples.
2. **Ranks**: rank ``r`` of ``R`` takes the contiguous part ``[r P, (r + 1) P)`` of that stream,
   ``P = N // R`` (so every rank reads about ``1 / R`` of the shards, a shard on a boundary
   partly; ``N mod R`` samples at the end are left out of the epoch).
3. **Shuffle buffer**: the rank's part passes through a buffer of ``data.shuffle_buffer``
   samples seeded from ``(seed, epoch, rank)`` (``tf.data`` semantics, see
   :func:`~vitflow.data.stream.shuffle_buffer`); the emitted order is cut into batches, and the
   tail that does not fill a batch (``P mod B`` samples) is dropped, so every rank has
   ``P // B`` batches. In all, fewer than ``R (B + 1)`` samples an epoch are left out, a
   different set each epoch as the shards are reshuffled.
4. **Workers**: a background thread of the rank's main process reads the shards (through
   :func:`~vitflow.data.wds.open_stream`) and hands each batch's encoded images to the
   DataLoader, whose workers decode and augment them (randomness seeded from
   ``(seed, rank, epoch, batch)``); so each shard is read once per epoch, by one rank.

Reading order is computed from indices first (as :mod:`vitflow.data.stream` does); bytes are held
only until their batch is complete (about one buffer: memory ~ ``shuffle_buffer`` x the mean
sample size). Resuming skips the shards that hold only consumed batches without opening them.
Samples that cannot be used (no label, no image, cut by a truncated shard, or missing: the shard
holds fewer samples than its index says) go into their batch's ``bad`` list with their shard and
key, and are counted in the skipped-images report like unreadable image files.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError
from vitflow.data.loader import stack_images
from vitflow.data.sources import DataError, ImageSource
from vitflow.data.splits import parse_split
from vitflow.data.stream import shuffle_buffer
from vitflow.data.transforms import Transform, transform_encoded
from vitflow.data.wds import ShardSet, iter_samples, open_stream, parse_label, shard_set
from vitflow.data.wdslayout import is_shard_pattern, split_urls
from vitflow.runtime import mix_seed

log = logging.getLogger(__name__)
Item = tuple  # (name, encoded bytes or None, label, error or None)


class ShardStream(ImageSource):
    """The training split of a shard set, read only by streaming (:class:`ShardBatches`).

    ``labels`` are ``-1`` (unknown until read); ``len`` is the samples the index counts.
    """

    streamed = True

    def __init__(self, shards: ShardSet):
        self.shards, self.classes = shards, shards.classes
        self.labels = np.full(shards.total, -1, dtype=np.int64)

    def name(self, i: int) -> str:
        return f"{self.shards.urls[0]}...[{i}]"

    def load(self, i: int) -> torch.Tensor:
        raise DataError("training shards are read by streaming, not by index")

    def subset(self, idx: np.ndarray) -> "ImageSource":
        raise DataError("training shards cannot be sliced; give the split as its own shards")


def open_shard_stream(path: str, split: str, classes_file: str | None = None) -> ShardStream:
    """The training split ``split`` (a name or a shard pattern) of the shard set ``path``.

    Raises:
        DataError: a sliced split expression (``train[:90%]``: make the held-out shards their own
            split), or see :func:`~vitflow.data.wdslayout.split_urls`.
    """
    if not is_shard_pattern(split):
        sp = parse_split(split)
        if sp.sliced:
            raise DataError(f"data.train_split={split!r}: training shards are streamed and cannot be sliced; write "
                            "the held-out part as shards of its own (a val split)")
        split = sp.name
    shards = shard_set(split_urls(path, split), classes_file)
    log.info("%s: %d shard(s), %d samples, %d classes", split, len(shards.urls), shards.total, len(shards.classes))
    return ShardStream(shards)


@dataclass
class ShardBatch:
    """Batch ``index`` of ``epoch``: its samples' ``items`` ``(name, bytes, label, error)``, in
    batch order, as read by the rank's main process (pickled to a loader worker)."""

    epoch: int
    index: int
    items: list


def rank_segments(counts: np.ndarray, seed: int, epoch: int, rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """``(shard, first sample, stop)`` runs making rank ``rank``'s part of ``epoch``'s stream
    (steps 1-2 of the module docstring), in reading order."""
    order = np.random.default_rng([seed, epoch, 0x5A4D]).permutation(len(counts))
    per_rank = int(counts.sum()) // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    segments, pos = [], 0
    for s in order:
        n = int(counts[s])
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            segments.append((int(s), a - pos, b - pos))
        pos += n
    return segments


class ShardBatches:
    """The batches of one rank, endless (or ``epochs`` long) from ``start = (epoch, batch)``;
    iterated as a DataLoader sampler (a background thread reads ahead ``ahead`` batches).

    Raises:
        DataError: fewer samples than one batch per rank.
    """

    def __init__(self, shards: ShardSet, batch_size: int, seed: int = 0, buffer_size: int = 50_000,
                 start: tuple[int, int] = (0, 0), rank: int = 0, world_size: int = 1, epochs: int | None = None,
                 ahead: int = 4):
        self.shards, self.batch_size, self.seed = shards, batch_size, seed
        self.per_rank = shards.total // world_size
        self.buffer_size = max(1, min(buffer_size, self.per_rank))
        self.start, self.rank, self.world_size, self.epochs, self.ahead = start, rank, world_size, epochs, ahead
        self.batches_per_epoch = self.per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"{shards.urls[0]}: {shards.total} samples cannot fill one batch of {batch_size} x "
                            f"{world_size} rank(s); lower train.batch_size")
        self._warned: set[str] = set()

    def batch_of(self, epoch: int, first: int = 0) -> np.ndarray:
        """For each position of the rank's stream, its batch (``-1``: dropped or before ``first``)
        times ``batch_size`` plus its slot in the batch."""
        rng = np.random.default_rng([self.seed, epoch, self.rank, 0x5EED])
        emitted = np.fromiter(shuffle_buffer(iter(range(self.per_rank)), self.buffer_size, rng), dtype=np.int64,
                              count=self.per_rank)
        where = np.full(self.per_rank, -1, dtype=np.int64)
        keep = emitted[first * self.batch_size:self.batches_per_epoch * self.batch_size]
        where[keep] = np.arange(first * self.batch_size, first * self.batch_size + len(keep))
        return where

    def epoch(self, epoch: int, first: int = 0) -> Iterator[ShardBatch]:
        """This rank's batches ``first, first + 1, ...`` of ``epoch``, read in stream order."""
        where, bs = self.batch_of(epoch, first), self.batch_size
        pending: dict[int, list] = {}
        nxt, pos = first, 0
        for shard, a, b in rank_segments(self.shards.counts, self.seed, epoch, self.rank, self.world_size):
            slots = where[pos:pos + b - a]
            pos += b - a
            if not (slots >= 0).any():
                continue  # holds only consumed or dropped samples: not opened
            for j, item in self._read(shard, a, b):
                slot = int(slots[j - a])
                if slot >= 0:
                    pending.setdefault(slot // bs, [None] * bs)[slot % bs] = item
            while nxt in pending and all(x is not None for x in pending[nxt]):
                yield ShardBatch(epoch, nxt, pending.pop(nxt))
                nxt += 1
        while nxt in pending:  # complete once the stream is read
            yield ShardBatch(epoch, nxt, pending.pop(nxt))
            nxt += 1

    def _read(self, shard: int, a: int, b: int) -> Iterator[tuple[int, Item]]:
        """``(sample index, item)`` for samples ``a .. b - 1`` of ``shard``; every index is given,
        those the shard lacks as an error item."""
        url, classes, j = self.shards.urls[shard], self.shards.classes, 0
        with open_stream(url) as f:
            for s in iter_samples(url, f):
                if j >= b:
                    break
                if j >= a:
                    yield j, self._item(url, s, classes)
                j += 1
        if j < b:
            if url not in self._warned:
                self._warned.add(url)
                log.warning("%s holds %d samples, the index says %d (truncated?)", url, j,
                            int(self.shards.counts[shard]))
            for k in range(max(j, a), b):
                yield k, (f"{url}:#{k}", None, -1, f"missing: the shard ends after {j} of "
                          f"{int(self.shards.counts[shard])} samples (truncated?)")

    @staticmethod
    def _item(url: str, s, classes: list[str]) -> Item:
        name = f"{url}:{s.key}"
        if s.error is not None:
            return name, None, -1, s.error
        ext = s.image_ext()
        if ext is None:
            return name, None, -1, "no image member (.jpg, .jpeg, .png or .webp)"
        try:
            return name, s.members[ext], parse_label(s, classes), None
        except ValueError as e:
            return name, None, -1, str(e)

    def _produce(self, out: queue.Queue, stop: threading.Event) -> None:
        try:
            epoch, first = self.start
            while (self.epochs is None or epoch < self.epochs) and not stop.is_set():
                for batch in self.epoch(epoch, first):
                    while not stop.is_set():
                        try:
                            out.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                epoch, first = epoch + 1, 0
            out.put(None)
        except BaseException as e:  # handed to the consumer, which raises it
            out.put(e)

    def __iter__(self) -> Iterator[ShardBatch]:
        q: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(q, stop), daemon=True, name="vitflow-shards")
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()


class ShardDecode(torch.utils.data.Dataset):
    """Decodes and augments a :class:`ShardBatch` into the batch dict of
    :class:`~vitflow.data.loader.BatchDataset` (``images`` uint8 ``(B, 3, S, S)``, ``labels`` int64
    ``(B,)``, ``epoch``, ``index``, ``bad``); randomness seeded from ``(seed, epoch, index)``."""

    def __init__(self, transform: Transform, seed: int):
        self.transform, self.seed = transform, seed

    def __getitem__(self, batch: ShardBatch) -> dict:
        images, labels, bad = [], [], []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, batch.epoch, batch.index))
            for name, data, label, error in batch.items:
                try:
                    if error is not None:
                        raise CorruptImageError(name, error)
                    images.append(transform_encoded(self.transform, data, name))
                    labels.append(label)
                except CorruptImageError as e:
                    bad.append((e.path, e.reason))
        return {"images": stack_images(images), "labels": torch.tensor(labels, dtype=torch.int64),
                "epoch": batch.epoch, "index": batch.index, "bad": bad}


def _identity(batch: dict) -> dict:
    return batch


def shard_loader(source: ShardStream, transform: Transform, batch_size: int, seed: int, aug_seed: int,
                 buffer_size: int, start: tuple[int, int], rank: int, world_size: int, workers: int,
                 prefetch: int) -> tuple[torch.utils.data.DataLoader, int]:
    """``(DataLoader of this rank's training batches, batches per epoch)`` for :func:`train_loader`."""
    sampler = ShardBatches(source.shards, batch_size, seed, buffer_size, start, rank, world_size,
                           ahead=max(2, prefetch * max(workers, 1)))
    kwargs = dict(prefetch_factor=prefetch, persistent_workers=True) if workers else {}
    loader = torch.utils.data.DataLoader(ShardDecode(transform, aug_seed), batch_size=None, sampler=sampler,
                                         num_workers=workers, collate_fn=_identity, generator=torch.Generator(),
                                         **kwargs)
    return loader, sampler.batches_per_epoch
