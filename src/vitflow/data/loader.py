"""Batches: resumable epoch samplers (random or class-balanced), a batch-producing dataset and the DataLoader around them.

Order and augmentation are functions of ``(seed, epoch, batch index)`` only:

- the sampler draws epoch ``e``'s permutation from ``(seed, e)``;
- each batch's augmentation randomness is seeded from ``(seed, epoch, batch index)``,

so a run resumed at ``(epoch, batch)`` sees exactly the batches an uninterrupted run would have
seen, whatever the number of worker processes, and no two batches share augmentation draws.
A worker produces a whole batch as ``uint8`` tensors; normalisation happens on the device.

Unreadable images policy: a corrupt, truncated or empty image file is skipped, its path is
reported in a warning (once) and counted per epoch; the batch is delivered without it.

Class-balanced sampling (``data.sampler=balanced``, :class:`BalancedSampler`): an epoch is ``n``
draws with replacement in which every class present in the split is equally likely (a class drawn
uniformly, then one of its images uniformly): image ``i`` of class ``c`` has probability
``1 / (K * count_c)`` per draw (``K`` classes present), the "class-balanced sampling" of Kang et al.
2020 ("Decoupling Representation and Classifier for Long-Tailed Recognition", ICLR; ``q = 0``) and
what ``torch.utils.data.WeightedRandomSampler`` does with those weights. Its draws too are a
function of ``(seed, epoch)`` only, and the ranks of a data-parallel run share them (rank ``r``
takes positions ``r, r + W, ...``), as with the permutation of the random sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from vitflow.data.decode import CorruptImageError
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.transforms import Transform, transform_encoded
from vitflow.runtime import mix_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchRef:
    """Which images make batch ``index`` of ``epoch`` (``indices`` into the source)."""

    epoch: int
    index: int
    indices: np.ndarray


class EpochSampler:
    """Yields :class:`BatchRef` for epochs ``start_epoch, start_epoch + 1, ...``.

    Args:
        n: source size.
        batch_size: images per batch (per rank).
        shuffle: permute each epoch (from ``(seed, epoch)``); otherwise source order.
        drop_last: drop the tail that does not fill a batch (training); else a last short batch.
        seed: order seed.
        epochs: number of epochs to yield; ``None`` = endless (training).
        start: ``(epoch, batch index)`` of the first batch to yield (resume).
        rank, world_size: shard of the epoch for data-parallel training: rank ``r`` takes
            positions ``r, r + W, ...`` of the permutation, truncated so every rank has the same
            number of batches.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int = 0,
                 epochs: int | None = None, start: tuple[int, int] = (0, 0), rank: int = 0, world_size: int = 1):
        if n <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.n, self.batch_size, self.shuffle, self.drop_last = n, batch_size, shuffle, drop_last
        self.seed, self.epochs, self.start = seed, epochs, start
        self.rank, self.world_size = rank, world_size
        per_rank = n // world_size
        self.batches_per_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{n} images cannot fill one batch of {batch_size} x {world_size} rank(s); "
                             "lower train.batch_size")

    def order(self, epoch: int) -> np.ndarray:
        """This rank's source indices for ``epoch``, in batch order."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle else np.arange(self.n)
        per_rank = self.n // self.world_size
        return perm[self.rank::self.world_size][:per_rank]

    def __iter__(self) -> Iterator[BatchRef]:
        epoch, first = self.start
        while self.epochs is None or epoch < self.epochs:
            order = self.order(epoch)
            for b in range(first, self.batches_per_epoch):
                yield BatchRef(epoch, b, order[b * self.batch_size:(b + 1) * self.batch_size])
            epoch, first = epoch + 1, 0


class BatchDataset(torch.utils.data.Dataset):
    """Map-style dataset keyed by :class:`BatchRef` that returns one collated batch::

        {"images": uint8 (B, 3, S, S), "labels": int64 (B,) or multi-hot uint8 (B, C), "epoch": int,
         "index": int, "bad": [(name, reason), ...]}

    ``B`` is the batch size minus any unreadable images. With ``transform=None`` the source
    must have ``fixed_size`` and the batch is one :meth:`ImageSource.load_batch` gather of the
    images not :meth:`ImageSource.known_unreadable`.
    """

    def __init__(self, source: ImageSource, transform: Transform | None, seed: int = 0):
        self.source, self.transform, self.seed = source, transform, seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, ref: BatchRef) -> dict:
        if self.transform is None:  # images already at the output size: one gather, no per-image work
            idx, bad = self.source.known_unreadable(ref.indices)
            return {"images": self.source.load_batch(idx), "labels": torch.from_numpy(self.source.labels[idx]),
                    "epoch": ref.epoch, "index": ref.index, "bad": bad}
        images, kept, bad = [], [], []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, ref.epoch, ref.index))
            for i in ref.indices:
                try:
                    data = self.source.encoded(int(i))
                    images.append(self.transform(self.source.load(int(i))) if data is None else
                                  transform_encoded(self.transform, data, self.source.name(int(i))))
                    kept.append(int(i))
                except CorruptImageError as e:
                    bad.append((e.path, e.reason))
        labels = torch.from_numpy(np.ascontiguousarray(self.source.labels[np.array(kept, dtype=np.int64)]))
        return {"images": stack_images(images), "labels": labels, "epoch": ref.epoch, "index": ref.index, "bad": bad}


def stack_images(images: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``uint8 (3, S, S)`` images into ``(B, 3, S, S)``. In a loader worker the batch is
    written straight into shared memory (as ``default_collate`` does), so handing it to the main
    process copies nothing."""
    if not images:
        return torch.empty(0, 3, 0, 0, dtype=torch.uint8)
    shape = (len(images), *images[0].shape)
    if torch.utils.data.get_worker_info() is None:
        return torch.stack(images)
    storage = torch.UntypedStorage._new_shared(int(np.prod(shape)) * images[0].element_size())
    out = torch.empty(0, dtype=images[0].dtype).set_(storage).view(shape)
    return torch.stack(images, out=out)


def _identity(batch: dict) -> dict:
    return batch


def make_loader(source: ImageSource, transform: Transform | None, sampler: EpochSampler, num_workers: int,
                prefetch: int = 2, seed: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader over whole batches (see :class:`BatchDataset`).

    ``prefetch`` batches per worker are kept ready. Workers persist across epochs. A private
    generator keeps the loader from consuming the global torch RNG, which stays the model's.

    Raises:
        DataError: ``num_workers > 0`` for a source that cannot go to worker processes
            (:meth:`ImageSource.worker_problem`: a user dataset that does not pickle).
    """
    if num_workers > 0 and (problem := source.worker_problem()):
        raise DataError(problem)
    kwargs = dict(prefetch_factor=prefetch, persistent_workers=True) if num_workers > 0 else {}
    return torch.utils.data.DataLoader(BatchDataset(source, transform, seed), batch_size=None, sampler=sampler,
                                       num_workers=num_workers, collate_fn=_identity,
                                       generator=torch.Generator(), **kwargs)


class SkipReport:
    """Counts unreadable images per epoch and warns once per file (the first time it is skipped).

    One report per kind of pass: the training epochs have theirs and the evaluations of the test
    split another, so that a bad test image is never counted in a training epoch."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.per_epoch: dict[int, int] = {}

    def add(self, epoch: int, bad: list[tuple[str, str]]) -> None:
        for name, reason in bad:
            self.per_epoch[epoch] = self.per_epoch.get(epoch, 0) + 1
            if name not in self.seen:
                self.seen.add(name)
                log.warning("skipped unreadable image %s: %s", name, reason)

    @property
    def total(self) -> int:
        return sum(self.per_epoch.values())


DISTRIBUTION_FILE = "class_counts.json"  # a run directory's class counts per split (train writes, the report reads)
_STREAM = 0xBA1  # a third seed word: the draws are not the random sampler's permutation stream


def class_counts(labels: np.ndarray, num_classes: int) -> list[int]:
    """Images per class: ``labels`` ``int (n,)`` class indices -> ``num_classes`` counts, or multi-hot
    ``(n, C)`` -> positives per class."""
    labels = np.asarray(labels)
    if labels.ndim == 2:
        return [int(v) for v in labels.astype(np.int64).sum(axis=0)]
    return [int(v) for v in np.bincount(labels.astype(np.int64), minlength=num_classes)[:num_classes]]


class BalancedSampler(EpochSampler):
    """An :class:`EpochSampler` (same arguments and batches per epoch, always
    shuffled, ``drop_last``) drawing every class equally often, with replacement (module docstring).

    Args:
        labels: ``int64 (n,)`` class indices of the source (single-label data).
    Raises:
        ValueError: empty or multi-hot ``labels``, or too few images for one batch.
    """

    def __init__(self, labels: np.ndarray, batch_size: int, seed: int = 0, epochs: int | None = None,
                 start: tuple[int, int] = (0, 0), rank: int = 0, world_size: int = 1):
        labels = np.asarray(labels)
        if labels.ndim != 1:
            raise ValueError("data.sampler=balanced needs single-label data (one class per image)")
        super().__init__(len(labels), batch_size, shuffle=True, drop_last=True, seed=seed, epochs=epochs,
                         start=start, rank=rank, world_size=world_size)
        self.by_class = np.argsort(labels, kind="stable")  # image indices grouped by class
        present, first, counts = np.unique(labels[self.by_class], return_index=True, return_counts=True)
        self.present, self.first, self.counts = present, first, counts

    def order(self, epoch: int) -> np.ndarray:
        """This rank's source indices for ``epoch``: ``n`` balanced draws, sharded like the parent's."""
        rng = np.random.default_rng([self.seed, epoch, _STREAM])
        cls = rng.integers(0, len(self.present), self.n)
        member = np.minimum((rng.random(self.n) * self.counts[cls]).astype(np.int64), self.counts[cls] - 1)
        draws = self.by_class[self.first[cls] + member]
        per_rank = self.n // self.world_size
        return draws[self.rank::self.world_size][:per_rank]


def epoch_sampler(kind: str, labels: np.ndarray, batch_size: int, seed: int, start: tuple[int, int] = (0, 0),
                  rank: int = 0, world_size: int = 1) -> EpochSampler:
    """The training sampler of ``data.sampler``: ``random`` (a permutation per epoch) or ``balanced``
    (:class:`BalancedSampler`), endless, from ``start = (epoch, batch index)``.

    Raises:
        ValueError: an unknown ``kind``; see the samplers.
    """
    if kind == "balanced":
        return BalancedSampler(labels, batch_size, seed, start=start, rank=rank, world_size=world_size)
    if kind != "random":
        raise ValueError(f"data.sampler={kind!r}: expected random or balanced")
    return EpochSampler(len(labels), batch_size, shuffle=True, drop_last=True, seed=seed, start=start, rank=rank,
                        world_size=world_size)
