"""Class-balanced sampling for imbalanced data (``data.sampler=balanced``) and the class counts of a split.

:class:`BalancedSampler` is an :class:`~vitflow.data.loader.EpochSampler` whose epoch order is ``n``
draws with replacement in which every class present in the split is equally likely (a class drawn
uniformly, then one of its images uniformly): image ``i`` of class ``c`` has probability
``1 / (K * count_c)`` per draw (``K`` classes present), the "class-balanced sampling" of Kang et al.
2020 ("Decoupling Representation and Classifier for Long-Tailed Recognition", ICLR; ``q = 0``) and
what ``torch.utils.data.WeightedRandomSampler`` does with those weights. An epoch is still ``n``
images. The draws are a function of ``(seed, epoch)`` only, so a run resumed at ``(epoch, batch)``
sees exactly the batches of an uninterrupted run, and the ranks of a data-parallel run share them
(rank ``r`` takes positions ``r, r + W, ...``), as with the permutation of the random sampler.
"""

from __future__ import annotations

import numpy as np

from vitflow.data.loader import EpochSampler

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
    """An :class:`~vitflow.data.loader.EpochSampler` (same arguments and batches per epoch, always
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
