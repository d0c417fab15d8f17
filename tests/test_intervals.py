"""95% intervals of an evaluation's figures: the Wilson interval against SciPy's and its coverage,
the bootstrap of macro-F1 against a plain per-resample computation and its coverage, and the
intervals an evaluation pass returns, its summary line shows and a run summary keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from vitflow.data.transforms import Preprocess
from vitflow.evaluation import evaluate
from vitflow.metrics import headline, interval_names
from vitflow.metrics.classification import confusion_metrics
from vitflow.metrics.intervals import balanced_accuracy, bootstrap, macro_f1, resampled_counts, wilson
from vitflow.runtime import resolve_precision


@pytest.mark.parametrize("hits,n", [(273, 341), (0, 20), (20, 20), (1, 3), (9_000, 10_000), (153, 153)])
def test_wilson_matches_scipy(hits: int, n: int):
    ours = wilson(hits, n)
    theirs = binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert ours == pytest.approx((theirs.low, theirs.high), abs=1e-9)
    assert 0.0 <= ours[0] <= hits / n <= ours[1] <= 1.0


def test_wilson_covers_the_true_accuracy_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    for p, n in ((0.8, 341), (0.97, 153), (0.5, 50)):
        hits = rng.binomial(n, p, size=4000)
        covered = np.mean([lo <= p <= hi for lo, hi in (wilson(h, n) for h in hits)])
        assert 0.93 <= covered <= 0.975, (p, n, covered)


def _per_image_bootstrap(confusion: np.ndarray, draws: int, seed: int) -> np.ndarray:
    """Macro-F1 of resampled images, one resample at a time, through confusion_metrics."""
    c = len(confusion)
    true, pred = np.divmod(np.repeat(np.arange(c * c), confusion.ravel()), c)
    rng, out = np.random.default_rng(seed), []
    for _ in range(draws):
        idx = rng.integers(0, len(true), len(true))
        m = np.bincount(true[idx] * c + pred[idx], minlength=c * c).reshape(c, c)
        out.append(confusion_metrics(m)["macro_f1"])
    return np.array(out)


@pytest.mark.parametrize("confusion", [
    np.array([[40, 10], [5, 45]]),  # fewer images than cells? no: 4 cells, 100 images (multinomial draws)
    np.array([[3, 1, 0], [0, 0, 1], [1, 0, 2]]),  # 8 images, 9 cells: image indices drawn; a class often absent
])
def test_the_bootstrap_agrees_with_resampling_one_image_set_at_a_time(confusion):
    vectorised = np.concatenate([macro_f1(*counts) for counts in resampled_counts(confusion, 4000, seed=0)])
    plain = _per_image_bootstrap(confusion, 4000, seed=1)
    assert vectorised.mean() == pytest.approx(plain.mean(), abs=0.01)
    for q in (0.025, 0.5, 0.975):  # the same distribution, up to Monte Carlo error
        assert np.quantile(vectorised, q) == pytest.approx(np.quantile(plain, q), abs=0.03)
    # every resample's counts are a resample: n images, TP <= support and <= predicted
    for support, predicted, tp in resampled_counts(confusion, 50):
        assert (support.sum(1) == confusion.sum()).all() and (predicted.sum(1) == confusion.sum()).all()
        assert (tp <= support).all() and (tp <= predicted).all()
    balanced = np.concatenate([balanced_accuracy(*c) for c in resampled_counts(confusion, 10)])
    assert ((0 <= balanced) & (balanced <= 1)).all()
    assert bootstrap(confusion, macro_f1) == bootstrap(confusion, macro_f1)  # seeded


def test_the_bootstrap_interval_covers_the_population_macro_f1():
    # a 4-class population; splits of 200 images drawn from it; its macro-F1 is the figure estimated
    population = np.array([[50, 5, 3, 2], [8, 30, 2, 0], [4, 4, 60, 2], [1, 0, 9, 20]], dtype=float)
    truth = confusion_metrics(population.astype(np.int64))["macro_f1"]
    rng, covered = np.random.default_rng(2), []
    for _ in range(300):
        split = rng.multinomial(200, population.ravel() / population.sum()).reshape(4, 4)
        low, high = bootstrap(split, macro_f1, draws=400, seed=int(rng.integers(1 << 30)))
        covered.append(low <= truth <= high)
    assert 0.89 <= np.mean(covered) <= 0.99  # the percentile bootstrap is close to nominal at this size


def test_an_evaluation_returns_its_intervals_and_the_line_shows_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 7))
    images = torch.randint(0, 256, (120, 3, 4, 4), dtype=torch.uint8)
    labels = model(images.float().div(255).sub(0.5).div(0.5)).argmax(1)  # the model's own answers ...
    labels[:30] = (labels[:30] + 1) % 7  # ... a quarter of them wrong: top-1 75%
    loader = [{"images": images[i:i + 40], "labels": labels[i:i + 40], "bad": []} for i in range(0, 120, 40)]
    pp = Preprocess(image_size=4, mean=(0.5,) * 3, std=(0.5,) * 3)
    r = evaluate(model, loader, torch.device("cpu"), resolve_precision("fp32", torch.device("cpu")), pp)
    assert r["top1"] == pytest.approx(0.75)
    assert r["top1_ci95"] == pytest.approx(list(wilson(90, 120)))
    assert r["macro_f1_ci95"][0] < r["macro_f1"] < r["macro_f1_ci95"][1]
    assert r["balanced_accuracy_ci95"][0] < r["balanced_accuracy"] < r["balanced_accuracy_ci95"][1]
    low, high = r["top1_ci95"]
    assert f"top-1 75.00% [{low * 100:.1f}-{high * 100:.1f}]" in headline(r)
    assert {"top1_ci95", "top5_ci95", "macro_f1_ci95", "balanced_accuracy_ci95"} <= set(interval_names())


def test_paired_difference_agrees_with_a_paired_bootstrap_and_is_narrower_than_two_wilsons():
    """Two models on the same 600 images, right on 70% and 66% with most images shared: the
    adjusted Wald interval of the difference matches the percentile bootstrap over images to
    within half a point, and is far narrower than the two top-1 intervals side by side."""
    from vitflow.metrics.intervals import paired_difference

    rng = np.random.default_rng(3)
    n = 600
    a = rng.random(n) < 0.70
    b = a.copy()  # 60 discordant images: 42 right for a only, 18 for b only
    b[rng.choice(np.flatnonzero(a), 42, replace=False)] = False
    b[rng.choice(np.flatnonzero(~a), 18, replace=False)] = True
    diff, (low, high) = paired_difference(a, b)
    assert diff == pytest.approx(a.mean() - b.mean())
    idx = rng.integers(0, n, size=(4000, n))
    boot = a[idx].mean(axis=1) - b[idx].mean(axis=1)
    assert low == pytest.approx(np.quantile(boot, 0.025), abs=0.005)
    assert high == pytest.approx(np.quantile(boot, 0.975), abs=0.005)
    wa, wb = wilson(a.sum(), n), wilson(b.sum(), n)
    assert high - low < 0.7 * min(wa[1] - wa[0], wb[1] - wb[0])  # narrower than either top-1's own interval
    assert low > 0  # 42 vs 18 discordant images: a is better, and the interval says so
    same, (lo, hi) = paired_difference(a, a)
    assert same == 0 and lo < 0 < hi and hi - lo < 0.01
    with pytest.raises(ValueError, match="600 and 5 images"):
        paired_difference(a, b[:5])
