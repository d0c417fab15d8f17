"""95% confidence intervals of an evaluation's figures, from what one pass counts: the Wilson
score interval of a proportion of images (top-1, top-5; Wilson 1927, which Brown, Cai & DasGupta
2001 recommend over the normal approximation, whose interval leaves [0, 1] and undercovers near 0
and 1), and the percentile bootstrap over the images (Efron & Tibshirani 1993, ch. 13) of a figure
of the per-class counts, for which there is no closed form (macro-F1, balanced accuracy); and the
interval of the difference between two models' top-1 on the same images (:func:`paired_difference`).

A top-1 of 80% on 341 images is 75.4% to 83.9%: a difference of a few points between two runs
evaluated on a few hundred images is within the noise of the split itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
DRAWS = 1000  # bootstrap resamples: the 2.5% and 97.5% quantiles move by ~0.1 point between seeds at 1,000
MIN_DRAWS, WORK = 200, 5_000_000  # fewer resamples (not below 200) where one costs over WORK / DRAWS numbers
Interval = tuple[float, float]
Statistic = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def wilson(hits: float, n: int, z: float = Z95) -> Interval:
    """The Wilson score interval of ``hits`` successes in ``n`` trials (fractions in [0, 1]).

    Raises:
        ValueError: ``n < 1`` or ``hits`` outside ``[0, n]``.
    """
    if n < 1 or not -1e-9 <= hits <= n + 1e-9:
        raise ValueError(f"wilson: {hits} hits in {n} trials")
    p, z2 = min(max(hits / n, 0.0), 1.0), z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: np.ndarray, b: np.ndarray, z: float = Z95) -> tuple[float, Interval]:
    """The difference of two models' top-1 on the same images, ``mean(a) - mean(b)``, and its 95%
    interval: the adjusted Wald interval for paired proportions (Agresti & Min 2005: half an image
    added to each of the four right/wrong cells). Only the images one model gets right and the
    other wrong move it, so it is much narrower than the two top-1 intervals side by side.

    Args:
        a, b: ``bool (n,)``: whether each model got image ``i`` right (the same images, in order).
    Raises:
        ValueError: different lengths, or no image.
    """
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired_difference: {a.size} and {b.size} images (the same images, at least one)")
    only_a, only_b = float(np.sum(a & ~b)) + 0.5, float(np.sum(~a & b)) + 0.5
    n = a.size + 2.0
    d = (only_a - only_b) / n
    half = z * math.sqrt(max(only_a + only_b - (only_a - only_b) ** 2 / n, 0.0)) / n
    return float(a.mean() - b.mean()), (max(-1.0, d - half), min(1.0, d + half))


def resampled_counts(confusion: np.ndarray, draws: int = DRAWS, seed: int = 0,
                     chunk_cells: int = 4_000_000) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Bootstrap resamples of the images behind ``confusion`` (``(C, C)`` counts, row: true
    class), each as its per-class ``(support, predicted, true positives)``, ``int64 (k, C)``
    arrays in chunks of ``k`` resamples (about ``chunk_cells`` numbers at a time, whatever the
    split's size); ``draws`` of them, or fewer (not under :data:`MIN_DRAWS`) where each would
    cost over ``WORK / DRAWS`` numbers (many classes and many images). Drawing ``n`` images with replacement is a multinomial draw over the matrix's
    cells: done so when the cells are fewer than the images, else by drawing image indices.
    Seeded: the same counts give the same resamples."""
    m = np.asarray(confusion, dtype=np.int64)
    c, n, rng = m.shape[0], int(m.sum()), np.random.default_rng(seed)
    draws = min(draws, max(MIN_DRAWS, WORK // min(c * c, n)))  # a large split: its interval is narrow anyway
    if c * c <= n:
        step = max(1, chunk_cells // (c * c))
        for start in range(0, draws, step):
            cells = rng.multinomial(n, m.ravel() / n, size=min(step, draws - start)).reshape(-1, c, c)
            yield cells.sum(axis=2), cells.sum(axis=1), np.diagonal(cells, axis1=1, axis2=2)
        return
    true, pred = np.divmod(np.repeat(np.arange(c * c), m.ravel()), c)  # one (true, predicted) pair per image
    hit = true == pred
    step = max(1, chunk_cells // max(n, 1))
    for start in range(0, draws, step):
        k = min(step, draws - start)
        idx = rng.integers(0, n, size=(k, n))
        offset = (np.arange(k) * c)[:, None]
        drawn_true = true[idx] + offset

        def count(flat: np.ndarray) -> np.ndarray:
            return np.bincount(flat, minlength=k * c).reshape(k, c)

        yield count(drawn_true.ravel()), count((pred[idx] + offset).ravel()), count(drawn_true[hit[idx]])


def bootstrap(confusion: np.ndarray, statistic: Statistic, draws: int = DRAWS, seed: int = 0,
              level: float = 0.95) -> Interval:
    """The percentile bootstrap interval of ``statistic(support, predicted, tp) -> (k,)`` (per-class
    counts of :func:`resampled_counts`) over ``draws`` resamples of the images of ``confusion``."""
    values = np.concatenate([statistic(*counts) for counts in resampled_counts(confusion, draws, seed)])
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _present_mean(values: np.ndarray, support: np.ndarray) -> np.ndarray:
    present = support > 0  # a class a resample holds no image of is left out, as in the figure itself
    return (values * present).sum(axis=1) / np.maximum(present.sum(axis=1), 1)


def macro_f1(support: np.ndarray, predicted: np.ndarray, tp: np.ndarray) -> np.ndarray:
    """Macro-F1 over the classes present, per row of per-class counts (as
    :func:`vitflow.metrics.classification.confusion_metrics`)."""
    denominator = support + predicted
    f1 = np.divide(2.0 * tp, denominator, out=np.zeros(tp.shape), where=denominator > 0)
    return _present_mean(f1, support)


def balanced_accuracy(support: np.ndarray, predicted: np.ndarray, tp: np.ndarray) -> np.ndarray:
    """The mean recall over the classes present, per row of per-class counts."""
    return _present_mean(np.divide(tp, support, out=np.zeros(tp.shape), where=support > 0), support)


def wilson_of(name: str) -> Callable[[Mapping[str, Any]], Interval]:
    """The interval of figure ``name``, a fraction of the evaluation's ``images``, for
    :attr:`vitflow.metrics.Metric.interval`."""
    return lambda r: wilson(r[name] * r["images"], int(r["images"]))


def bootstrap_of(statistic: Statistic) -> Callable[[Mapping[str, Any]], Interval]:
    """The bootstrap interval of ``statistic`` over the evaluation's ``confusion`` matrix, for
    :attr:`vitflow.metrics.Metric.interval`."""
    return lambda r: bootstrap(r["confusion"], statistic)
