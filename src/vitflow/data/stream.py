"""Streaming reads through a shuffle buffer, for data read sequentially (a tar on slow or remote
storage) rather than by random access.

Each epoch's order is the storage order (tar member offsets) passed through a shuffle buffer of
``buffer_size`` images, as ``tf.data.Dataset.shuffle`` does: fill the buffer, then for each new
item emit a uniformly chosen buffered one and put the new one in its place; drain the buffer in
random order at the end. The buffer's RNG is seeded from ``(seed, epoch)``, so the order is
reproducible and every item is emitted exactly once an epoch.

The order depends only on indices, so it is computed first; the bytes are then read strictly in
storage order and held only until their batch is complete (about one buffer window). With ``W``
loader workers each worker reads and decodes only the batches whose running number (across
epochs) is ``worker id`` modulo ``W``;
PyTorch's DataLoader collects workers round-robin, so batches arrive in order. Resuming at
``(epoch, batch)`` recomputes the order and skips the consumed batches without reading them.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError
from vitflow.data.loader import stack_images
from vitflow.data.sources.base import FileSource
from vitflow.data.transforms import Transform, transform_encoded
from vitflow.runtime import mix_seed


def shuffle_buffer(items: Iterator, buffer_size: int, rng: np.random.Generator) -> Iterator:
    """Yield every element of ``items`` exactly once, locally shuffled through a buffer of
    ``buffer_size`` (``tf.data`` semantics)."""
    buf: list = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = int(rng.integers(buffer_size))
        yield buf[j]
        buf[j] = item
    order = rng.permutation(len(buf))
    for j in order:
        yield buf[j]


class StreamBatches(torch.utils.data.IterableDataset):
    """Endless (or ``epochs``-long) batches from a tar-backed :class:`FileSource`, read in
    storage order through :func:`shuffle_buffer`; same batch dict as
    :class:`vitflow.data.loader.BatchDataset`.

    Args:
        buffer_size: shuffle-buffer size in images (capped at the dataset size).
        start: ``(epoch, batch index)`` to resume at.
        rank, world_size: rank ``r`` keeps stream positions ``r, r + W, ...``, truncated so every
            rank has the same number of batches; the tail that does not fill a batch is dropped.
    """

    def __init__(self, source: FileSource, transform: Transform, batch_size: int, seed: int = 0,
                 buffer_size: int = 50_000, start: tuple[int, int] = (0, 0), epochs: int | None = None,
                 rank: int = 0, world_size: int = 1):
        self.source, self.transform, self.batch_size, self.seed = source, transform, batch_size, seed
        self.buffer_size = max(1, min(buffer_size, len(source)))
        self.start, self.epochs, self.rank, self.world_size = start, epochs, rank, world_size
        self.storage_order = np.argsort(source.spans[:, 0], kind="stable") if source.spans is not None \
            else np.arange(len(source))
        self.batches_per_epoch = (len(source) // world_size) // batch_size

    def epoch_order(self, epoch: int) -> Iterator[int]:
        """Source indices of this rank's images for ``epoch``, in emission order."""
        rng = np.random.default_rng([self.seed, epoch, 0x5EED])
        emitted = shuffle_buffer(iter(self.storage_order), self.buffer_size, rng)
        keep = self.batches_per_epoch * self.batch_size
        taken = 0
        for pos, i in enumerate(emitted):
            if pos % self.world_size == self.rank:
                yield int(i)
                taken += 1
                if taken == keep:
                    return

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        epoch, first = self.start
        origin = epoch * self.batches_per_epoch + first  # batches are dealt to workers by global number
        while self.epochs is None or epoch < self.epochs:
            yield from self._epoch(epoch, first, lambda b: (epoch * self.batches_per_epoch + b - origin) % nw == wid)
            epoch, first = epoch + 1, 0

    def _epoch(self, epoch: int, first: int, is_mine) -> Iterator[dict]:
        """Read this worker's images in storage order; emit its batches in batch order as each
        completes (pending bytes stay within about one shuffle-buffer window / workers)."""
        emitted = list(self.epoch_order(epoch))
        bs = self.batch_size
        mine = [b for b in range(first, self.batches_per_epoch) if is_mine(b)]
        if not mine:
            return
        wanted = {emitted[p]: b for b in mine for p in range(b * bs, (b + 1) * bs)}
        pending: dict[int, dict[int, bytes | CorruptImageError]] = {b: {} for b in mine}
        queue = iter(mine)
        nxt = next(queue)
        for i in self.storage_order:
            b = wanted.get(int(i))
            if b is None:
                continue
            try:
                pending[b][int(i)] = self.source.read(int(i))
            except CorruptImageError as e:
                pending[b][int(i)] = e
            while nxt is not None and len(pending[nxt]) == bs:
                got = pending.pop(nxt)
                yield self._make(epoch, nxt, [(j, got[j]) for j in emitted[nxt * bs:(nxt + 1) * bs]])
                nxt = next(queue, None)

    def _make(self, epoch: int, index: int, items: list[tuple[int, bytes | CorruptImageError]]) -> dict:
        images, labels, bad = [], [], []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, epoch, index))
            for i, data in items:
                try:
                    if isinstance(data, CorruptImageError):
                        raise data
                    images.append(transform_encoded(self.transform, data, self.source.name(i)))
                    labels.append(int(self.source.labels[i]))
                except CorruptImageError as e:
                    bad.append((e.path, e.reason))
        return {"images": stack_images(images), "labels": torch.tensor(labels, dtype=torch.int64), "epoch": epoch,
                "index": index, "bad": bad}
