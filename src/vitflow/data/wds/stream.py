"""Training from WebDataset shards: each epoch is cut into streams read sequentially, once,
through a shuffle buffer each; a rank reads its streams in a background thread and its loader
workers decode and augment whole batches.

The epoch order is a function of ``(seed, epoch, S, global batch)`` only, never of the number of
loader workers, nor (for any rank count ``R`` dividing ``S``) of the number of ranks:

1. **Shards**: permuted from ``(seed, epoch)``; their samples (counts from the index) laid end to
   end make the epoch's ``N`` samples.
2. **Streams**: cut into ``S = data.shard_streams`` (``auto``: one per rank) equal contiguous
   parts of ``N // S`` samples (a shard on a boundary is read in part by both streams; the
   ``N mod S`` samples at the end are left out of the epoch).
3. **Shuffle buffer**: each stream passes through a buffer of ``data.shuffle_buffer`` samples
   seeded from ``(seed, epoch, stream)`` (``tf.data`` semantics, see
   :func:`~vitflow.data.stream.shuffle_buffer`); its emitted order is cut into chunks of
   ``c = global batch / S`` samples and the tail that does not fill a chunk is dropped. In all,
   fewer than ``S (c + 1)`` samples an epoch are left out, a different set each epoch.
4. **Ranks**: rank ``r`` reads streams ``r S / R .. (r + 1) S / R - 1``; its batch ``b`` is chunk
   ``b`` of each, so every rank has ``(N // S) // c`` batches and the ranks' batches ``b``
   together are the same global batch whatever ``R``: a one-process run with the same
   ``data.shard_streams`` and global batch sees what ``R`` ranks see, and a resume on another
   rank count (dividing ``S``) continues the same order.
5. **Workers**: a background thread of the rank's main process reads its streams and hands
   each batch's images to the DataLoader as ``(file, offset, size)``: it parses a shard's tar
   headers and seeks past the image bytes, which the loader workers read with ``os.pread`` where
   they decode and augment them (randomness seeded from ``(seed, epoch, batch, stream)``: a sample
   draws the same crop and flip on any rank count). A remote shard is first copied to a local
   spool file (:mod:`vitflow.data.wds.spool`: downloaded while the stream reads the shard before
   it, deleted once its samples are decoded); a gzip-compressed one is decompressed as a stream
   and its images' bytes handed over. Each shard is read once per epoch (twice on a boundary).

The reading order is computed from indices first (as :mod:`vitflow.data.stream` does); bytes are
held only until their chunk is complete (memory ~ ``shuffle_buffer`` x the mean sample size per
stream). Resuming at ``(epoch, batch)`` skips the shards that hold only consumed samples without
opening them. Samples that cannot be used (no label, no image, cut by a truncated shard, or
missing: the shard holds fewer samples than its index says) go into their batch's ``bad`` list
with their shard and key, and are counted in the skipped-images report like unreadable images.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError
from vitflow.data.loader import stack_images
from vitflow.data.remote.fs import is_remote, local_path, open_stream
from vitflow.data.sources.base import DataError
from vitflow.data.stream import shuffle_buffer
from vitflow.data.transforms import Transform, transform_encoded
from vitflow.data.wds.index import ShardSet
from vitflow.data.wds.kind import ShardStream, open_shard_stream  # noqa: F401  (the training split, read here)
from vitflow.data.wds.shards import CUT_SAMPLE, is_compressed, iter_samples, parse_label, truncated
from vitflow.data.wds.spool import Spool
from vitflow.runtime import mix_seed

PARSED_MAX_SAMPLES = 2_000_000  # local shards' parsed samples a stream keeps (~200 bytes each)
Item = tuple  # (name, encoded bytes or None, label, error or None)


@dataclass
class ShardBatch:
    """Batch ``index`` of ``epoch``: its samples' ``items`` ``(name, bytes, label, error)``, in
    batch order, as read by the rank's main process (pickled to a loader worker)."""

    epoch: int
    index: int
    items: list
    streams: list = field(default_factory=lambda: [0])  # the streams whose chunks make ``items``, in order


def stream_segments(counts: np.ndarray, seed: int, epoch: int, stream: int, streams: int) -> list[tuple[int, int, int]]:
    """``(shard, first sample, stop)`` runs making stream ``stream``'s part of ``epoch``'s samples
    (steps 1-2 of the module docstring), in reading order."""
    order = np.random.default_rng([seed, epoch, 0x5A4D]).permutation(len(counts))
    per_stream = int(counts.sum()) // streams
    lo, hi = stream * per_stream, (stream + 1) * per_stream
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

    Args:
        batch_size: images per batch of this rank.
        streams: the streams an epoch is cut into (default: one per rank); rank ``r`` reads
            streams ``r S / R .. (r + 1) S / R - 1`` and its batch ``b`` is chunk ``b`` of each.
        lag: batches the consumer may still be decoding after asking for the next one (the
            DataLoader's ``prefetch_factor x workers``, plus one): how long spooled shards are kept.
    Raises:
        DataError: ``streams`` not a multiple of ``world_size`` or not dividing the global batch;
            fewer samples than one batch.
    """

    def __init__(self, shards: ShardSet, batch_size: int, seed: int = 0, buffer_size: int = 50_000,
                 start: tuple[int, int] = (0, 0), rank: int = 0, world_size: int = 1, epochs: int | None = None,
                 ahead: int = 4, streams: int | None = None, lag: int = 2):
        streams = streams or world_size
        if streams % world_size or (batch_size * world_size) % streams:
            raise DataError(f"data.shard_streams={streams} must be a multiple of the {world_size} rank(s) and divide "
                            f"the global batch of {batch_size * world_size} images")
        self.shards, self.batch_size, self.seed, self.streams = shards, batch_size, seed, streams
        self.mine = range(rank * streams // world_size, (rank + 1) * streams // world_size)
        self.chunk = batch_size * world_size // streams
        self.per_stream = shards.total // streams
        self.buffer_size = max(1, min(buffer_size, self.per_stream))
        self.start, self.epochs, self.ahead, self.lag = start, epochs, ahead, lag
        self.batches_per_epoch = self.per_stream // self.chunk
        if self.batches_per_epoch == 0:
            raise DataError(f"{shards.urls[0]}: {shards.total} samples cannot fill one batch of {batch_size} x "
                            f"{world_size} rank(s); lower train.batch_size")
        self._warned: set[str] = set()
        self._parsed: dict[tuple, list] = {}  # local shards' items, by (path, size, mtime): parsed once
        self._parsed_samples = 0
        self._active: list[tuple[threading.Event, Spool]] = []  # the running iterations' stop flags and spools

    def slots(self, epoch: int, stream: int, first: int = 0) -> np.ndarray:
        """For each position of ``stream``'s part, its place in the stream's emitted order
        (chunk ``k`` is places ``k c .. (k + 1) c - 1``); ``-1``: dropped, or in a chunk before ``first``."""
        rng = np.random.default_rng([self.seed, epoch, stream, 0x5EED])
        emitted = np.fromiter(shuffle_buffer(iter(range(self.per_stream)), self.buffer_size, rng), dtype=np.int64,
                              count=self.per_stream)
        where = np.full(self.per_stream, -1, dtype=np.int64)
        keep = emitted[first * self.chunk:self.batches_per_epoch * self.chunk]
        where[keep] = np.arange(first * self.chunk, first * self.chunk + len(keep))
        return where

    def chunks(self, epoch: int, stream: int, first: int, spool: Spool) -> Iterator[list]:
        """Chunks ``first, first + 1, ...`` of ``stream`` in ``epoch`` (lists of items), read in
        order; each kept item of a spooled shard holds its file."""
        where, c = self.slots(epoch, stream, first), self.chunk
        pending, filled = {}, {}  # chunk -> its items so far / their count
        reads, pos, nxt = [], 0, first  # reads: the segments holding samples still to give (others unopened)
        for shard, a, b in stream_segments(self.shards.counts, self.seed, epoch, stream, self.streams):
            slots, pos = where[pos:pos + b - a], pos + b - a
            if (slots >= 0).any():
                reads.append((shard, a, b, slots))
        for k, (shard, a, b, slots) in enumerate(reads):
            if k + 1 < len(reads):
                spool.prefetch(self.shards.urls[reads[k + 1][0]])  # the next shard downloads while this one is read
            for j, item in self._read(shard, a, b, spool):
                slot = int(slots[j - a])
                if slot < 0:
                    continue
                if isinstance(item[1], tuple):
                    spool.hold(item[1][0])
                pending.setdefault(slot // c, [None] * c)[slot % c] = item
                filled[slot // c] = filled.get(slot // c, 0) + 1
                while filled.get(nxt) == c:
                    del filled[nxt]
                    yield pending.pop(nxt)
                    nxt += 1

    def epoch(self, epoch: int, first: int, spool: Spool) -> Iterator[ShardBatch]:
        """This rank's batches ``first, first + 1, ...`` of ``epoch``: chunk ``b`` of each of its streams."""
        streams = [self.chunks(epoch, s, first, spool) for s in self.mine]
        for b in range(first, self.batches_per_epoch):
            yield ShardBatch(epoch, b, [item for chunks in streams for item in next(chunks)], list(self.mine))

    def _read(self, shard: int, a: int, b: int, spool: Spool) -> Iterator[tuple[int, Item]]:
        """``(sample index, item)`` for samples ``a .. b - 1`` of ``shard``; every index is given,
        those the shard lacks as an error item."""
        url, j, cut = self.shards.urls[shard], 0, 0
        for item in self._items(url, b, spool):
            if j >= a:
                yield j, item
            j, cut = j + 1, int(str(item[3]).startswith(CUT_SAMPLE))  # the last sample read, cut by the end?
        if j < b:
            why = truncated(url, j - cut, int(self.shards.counts[shard]), bool(cut), warn=url not in self._warned)
            self._warned.add(url)
            for k in range(max(j, a), b):
                yield k, (f"{url}:#{k}", None, -1, f"missing: {why}")

    def _items(self, url: str, stop: int, spool: Spool) -> Iterator[Item]:
        """The items of samples ``0 .. stop - 1`` of shard ``url`` (fewer when it holds fewer), in
        order. Images are ``(file, offset, size)`` (a remote shard spooled first), bytes for a
        compressed shard. A local shard read to its end is kept (up to :data:`PARSED_MAX_SAMPLES`
        samples in all) and not parsed again while its size and mtime are unchanged."""
        compressed, key = is_compressed(url), None
        if not compressed and not is_remote(url):
            st = os.stat(local_path(url))
            key = (url, st.st_size, st.st_mtime_ns)
            if key in self._parsed:
                yield from itertools.islice(self._parsed[key], stop)
                return
        path = url if compressed or key is not None else spool.fetch(url)
        items: list = []
        try:
            with open_stream(url) if compressed else open(local_path(path), "rb") as f:
                size = None if compressed else os.fstat(f.fileno()).st_size
                for s in iter_samples(url, f, read_images=compressed):
                    if len(items) >= stop:
                        return  # not read to its end: not kept
                    items.append(self._item(url, s, self.shards.classes, size, path))
                    yield items[-1]
        finally:
            if path != url:
                spool.done_reading(path)
        if key is not None and self._parsed_samples + len(items) <= PARSED_MAX_SAMPLES:
            self._parsed[key] = items
            self._parsed_samples += len(items)

    @staticmethod
    def _item(url: str, s, classes: list[str], size: int | None = None, path: str | None = None) -> Item:
        """The sample's item; its image is the bytes, or ``(path, offset, length)`` in the local file
        ``path`` (the shard or its spooled copy, ``size`` bytes long), read where it is decoded."""
        name = f"{url}:{s.key}"
        if s.error is not None:
            return name, None, -1, s.error
        ext = s.image_ext()
        if ext is None:
            return name, None, -1, "no image member (.jpg, .jpeg, .png or .webp)"
        data = s.members[ext]
        if isinstance(data, tuple):
            if data[0] + data[1] > size:
                return name, None, -1, CUT_SAMPLE
            data = (path or url, *data)
        try:
            return name, data, parse_label(s, classes), None
        except ValueError as e:
            return name, None, -1, str(e)

    @staticmethod
    def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
        """Put ``item`` unless the consumer has gone (``stop``); False then."""
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, out: queue.Queue, stop: threading.Event, spool: Spool) -> None:
        try:
            epoch, first = self.start
            while self.epochs is None or epoch < self.epochs:
                for batch in self.epoch(epoch, first, spool):
                    if not self._put(out, batch, stop):
                        return
                epoch, first = epoch + 1, 0
            self._put(out, None, stop)
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(out, e, stop)

    def __iter__(self) -> Iterator[ShardBatch]:
        """The batches, read ahead by a background thread; a batch's spooled files are released
        ``lag`` batches after it is handed over. The spool is removed when the consumer stops
        iterating early, or by :meth:`close` after the last batch (the DataLoader may still be
        decoding the last ``lag - 1`` batches when it finds the sampler exhausted)."""
        q: queue.Queue = queue.Queue(maxsize=self.ahead)
        stop, spool = threading.Event(), Spool(self.lag)
        self._active.append((stop, spool))
        thread = threading.Thread(target=self._produce, args=(q, stop, spool), daemon=True, name="vitflow-shards")
        thread.start()
        handed: collections.deque = collections.deque()
        ended = False
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
                handed.append([d[0] for _, d, _, _ in item.items if isinstance(d, tuple)])
                if len(handed) > self.lag:
                    spool.release(handed.popleft())
            ended = True
        finally:
            stop.set()
            if not ended:
                spool.close()
                self._active.remove((stop, spool))

    def close(self) -> None:
        """Stop the reader threads of the iterations still running and remove their spools (an
        iteration that the DataLoader keeps suspended, as its persistent workers do)."""
        for stop, spool in list(self._active):
            stop.set()
            spool.close()


class ShardDecode(torch.utils.data.Dataset):
    """Decodes and augments a :class:`ShardBatch` into the batch dict of
    :class:`~vitflow.data.loader.BatchDataset` (``images`` uint8 ``(B, 3, S, S)``, ``labels`` int64
    ``(B,)``, ``epoch``, ``index``, ``bad``). The randomness of each stream's chunk is seeded from
    ``(seed, epoch, index, stream)``: a sample draws the same augmentation whatever the rank count."""

    def __init__(self, transform: Transform, seed: int):
        self.transform, self.seed = transform, seed

    @staticmethod
    def _pread(fds: dict[str, int], name: str, path: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the local file ``path`` (opened once a batch, in ``fds``:
        a spooled shard deleted after its batches holds no memory in a worker). Raises
        CorruptImageError naming the sample when they cannot be read."""
        try:
            if path not in fds:
                fds[path] = os.open(local_path(path), os.O_RDONLY)
            return os.pread(fds[path], size, offset)
        except OSError as e:
            raise CorruptImageError(name, f"cannot read it: {e.strerror or e}") from None

    def __getitem__(self, batch: ShardBatch) -> dict:
        images, labels, bad, fds = [], [], [], {}
        chunk = len(batch.items) // len(batch.streams)
        try:
            self._decode(batch, chunk, fds, images, labels, bad)
        finally:
            for fd in fds.values():
                os.close(fd)
        return {"images": stack_images(images), "labels": torch.tensor(labels, dtype=torch.int64),
                "epoch": batch.epoch, "index": batch.index, "bad": bad}

    def _decode(self, batch: ShardBatch, chunk: int, fds: dict, images: list, labels: list, bad: list) -> None:
        with torch.random.fork_rng(devices=[]):
            for k, (name, data, label, error) in enumerate(batch.items):
                if k % chunk == 0:
                    torch.manual_seed(mix_seed(self.seed, batch.epoch, batch.index, batch.streams[k // chunk]))
                try:
                    if error is not None:
                        raise CorruptImageError(name, error)
                    if isinstance(data, tuple):
                        data = self._pread(fds, name, *data)
                    images.append(transform_encoded(self.transform, data, name))
                    labels.append(label)
                except CorruptImageError as e:
                    bad.append((e.path, e.reason))


def _identity(batch: dict) -> dict:
    return batch


def shard_loader(source: ShardStream, transform: Transform, batch_size: int, seed: int, buffer_size: int,
                 start: tuple[int, int], rank: int, world_size: int, workers: int, prefetch: int,
                 streams: int | None = None, epochs: int | None = None) -> tuple[torch.utils.data.DataLoader, int]:
    """``(DataLoader of this rank's training batches, batches per epoch)`` for :func:`train_loader`."""
    sampler = ShardBatches(source.shards, batch_size, seed, buffer_size, start, rank, world_size, epochs,
                           ahead=max(2, prefetch * max(workers, 1)), streams=streams,
                           lag=(prefetch if workers else 1) * max(workers, 1) + 1)
    kwargs = dict(prefetch_factor=prefetch, persistent_workers=True) if workers else {}
    loader = torch.utils.data.DataLoader(ShardDecode(transform, seed), batch_size=None, sampler=sampler,
                                         num_workers=workers, collate_fn=_identity, generator=torch.Generator(),
                                         **kwargs)
    return loader, sampler.batches_per_epoch
