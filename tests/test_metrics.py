"""Multi-label metrics (vitflow.metrics.multilabel) against scikit-learn's definitions."""

import json
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score, precision_score, recall_score

from vitflow.metrics.multilabel import (
    DEFAULT_THRESHOLD_GRID,
    average_precision,
    choose_threshold,
    f1_scores,
    mean_average_precision,
    multilabel_metrics,
)

NO_POSITIVE, NO_PREDICTION, ALL_POSITIVE = 2, 4, 5


@pytest.fixture
def data():
    """Seeded scores with many ties (rounded to 0.05 steps), class 2 without any positive, class 4
    never predicted at 0.5, class 5 all positive."""
    rng = np.random.default_rng(0)
    n, c = 300, 7
    targets = (rng.random((n, c)) < 0.3).astype(np.int64)
    targets[:, NO_POSITIVE] = 0
    targets[:, ALL_POSITIVE] = 1
    noisy = np.clip(targets * 0.3 + rng.random((n, c)) * 0.7, 0, 1)  # informative, but far from perfect
    probs = np.round(noisy / 0.05) * 0.05
    probs[:, NO_PREDICTION] *= 0.4
    assert len(np.unique(probs[:, 0])) < 25  # heavy ties
    return probs, targets


def _sklearn_ap(probs, targets):
    return np.array([average_precision_score(targets[:, c], probs[:, c]) if targets[:, c].any() else np.nan
                     for c in range(targets.shape[1])])


def test_average_precision_equals_sklearn_with_ties(data):
    probs, targets = data
    ap = average_precision(probs, targets)
    assert ap.dtype == np.float64 and ap.shape == (7,)
    assert np.isnan(ap[NO_POSITIVE]) and np.isnan(ap).sum() == 1
    np.testing.assert_allclose(ap, _sklearn_ap(probs, targets), rtol=0, atol=1e-12)
    assert ap[ALL_POSITIVE] == pytest.approx(1.0, abs=1e-12)
    assert 0.4 < np.nanmean(ap) < 0.9  # informative scores: well above the positive rate (0.3), below perfect
    # the dtype of the targets does not matter, torch tensors are accepted
    np.testing.assert_array_equal(average_precision(torch.from_numpy(probs), torch.from_numpy(targets).bool()), ap)


def test_average_precision_handles_ties_like_sklearn_on_a_hand_case():
    # thresholds 0.9 (1 pos, 1 neg), 0.5 (1 pos), 0.1 (1 pos, 2 neg): AP = 1/3*1/2 + 1/3*2/3 + 1/3*3/6
    scores = np.array([[0.9], [0.9], [0.5], [0.1], [0.1], [0.1]])
    targets = np.array([[1], [0], [1], [0], [1], [0]])
    expected = (1 / 2 + 2 / 3 + 3 / 6) / 3
    assert average_precision(scores, targets)[0] == pytest.approx(expected, abs=1e-15)
    assert scores[1, 0] == 0.9 and scores[2, 0] == 0.5  # the input is not sorted in place (a (n, 1) array)
    assert average_precision_score(targets[:, 0], scores[:, 0]) == pytest.approx(expected, abs=1e-15)
    assert average_precision(-scores, targets)[0] < expected  # reversing the order is worse


def test_average_precision_on_larger_random_float32_scores():
    rng = np.random.default_rng(1)
    scores = rng.standard_normal((5000, 40)).astype(np.float32).round(2)  # float32, ties
    targets = rng.random((5000, 40)) < np.linspace(0.001, 0.5, 40)
    scores = scores + targets * 0.5
    before = scores.copy()
    np.testing.assert_allclose(average_precision(scores, targets), _sklearn_ap(scores, targets), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(scores, before)


def test_mean_average_precision_skips_classes_without_positives(data):
    probs, targets = data
    expected = np.mean([average_precision_score(targets[:, c], probs[:, c]) for c in range(7) if c != NO_POSITIVE])
    assert mean_average_precision(probs, targets) == pytest.approx(expected, abs=1e-12)
    assert isinstance(mean_average_precision(probs, targets), float)
    with pytest.raises(ValueError, match="no class has a positive"):
        mean_average_precision(probs, np.zeros_like(targets))


def test_f1_scores_equal_sklearn(data):
    probs, targets = data
    predicted = probs >= 0.5
    assert not predicted[:, NO_PREDICTION].any() and predicted[:, NO_POSITIVE].any()
    got = f1_scores(predicted, targets)
    present = [c for c in range(targets.shape[1]) if targets[:, c].any()]  # macro: the classes the split has
    assert len(present) < targets.shape[1]  # (the data holds a class without a positive: it is left out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zero_division=0 is explicit: sklearn must not warn
        for avg, labels in (("micro", None), ("macro", present)):
            kw = dict(average=avg, labels=labels, zero_division=0)
            assert got[f"{avg}_f1"] == pytest.approx(f1_score(targets, predicted, **kw), abs=1e-12)
            assert got[f"{avg}_precision"] == pytest.approx(precision_score(targets, predicted, **kw), abs=1e-12)
            assert got[f"{avg}_recall"] == pytest.approx(recall_score(targets, predicted, **kw), abs=1e-12)
    assert all(type(v) is float for v in got.values()) and 0.3 < got["micro_f1"] < 0.9
    assert got["macro_f1"] < got["micro_f1"]  # the never-predicted class counts 0 in the macro mean


def test_f1_scores_degenerate_cases():
    zeros = np.zeros((3, 2), dtype=bool)
    assert f1_scores(zeros, zeros) == dict.fromkeys(
        ["micro_f1", "macro_f1", "micro_precision", "micro_recall", "macro_precision", "macro_recall"], 0.0)
    ones = np.ones((3, 2), dtype=bool)
    assert f1_scores(ones, ones)["micro_f1"] == 1.0 and f1_scores(ones, ones)["macro_f1"] == 1.0
    with pytest.raises(ValueError, match="only 0 and 1"):
        f1_scores(ones, np.full((3, 2), 0.5))
    with pytest.raises(ValueError, match="shape"):
        f1_scores(ones, np.ones((3, 3)))


def _brute_force_threshold(probs, targets, grid):
    f1 = [f1_score(targets, probs >= g, average="micro", zero_division=0) for g in grid]
    best = [g for g, f in zip(grid, f1) if f == max(f1)]
    return min(best, key=lambda g: (abs(g - 0.5), g)), max(f1)


def test_choose_threshold_maximises_micro_f1_like_a_brute_force_search(data):
    probs, targets = data
    grid = list(DEFAULT_THRESHOLD_GRID)
    assert grid[0] == 0.05 and grid[-1] == 0.95 and len(grid) == 19
    best, best_f1 = _brute_force_threshold(probs, targets, grid)
    got = choose_threshold(probs, targets)
    assert got == best and type(got) is float
    assert f1_scores(probs >= got, targets)["micro_f1"] == pytest.approx(best_f1, abs=1e-12)
    # a custom (unsorted) grid
    grid = [0.7, 0.2, 0.33, 0.5, 0.41]
    assert choose_threshold(probs, targets, grid) == _brute_force_threshold(probs, targets, grid)[0]
    with pytest.raises(ValueError, match="grid"):
        choose_threshold(probs, targets, [])


def test_choose_threshold_ties_go_to_the_threshold_closest_to_one_half():
    targets = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    # positives at 0.8, negatives at 0.2: every threshold in (0.2, 0.8] is perfect, 0.5 among them
    assert choose_threshold(np.where(targets == 1, 0.8, 0.2), targets) == 0.5
    # positives at 0.33, negatives at 0.12: 0.15 ... 0.30 are perfect, 0.30 is the closest to 0.5
    assert choose_threshold(np.where(targets == 1, 0.33, 0.12), targets) == 0.3
    # symmetric tie around 0.5: the smaller threshold
    assert choose_threshold(np.where(targets == 1, 0.6, 0.2), targets, [0.3, 0.7]) == 0.3


def test_threshold_comparison_is_exact_for_float32_probabilities():
    p32 = np.float32(0.7)
    assert p32 < np.float64(0.7) and p32 >= 0.7  # float32(0.7) rounds down; NumPy compares in float32
    probs = np.array([[p32, 0.9], [0.1, 0.1]], dtype=np.float32)
    targets = np.array([[1, 1], [0, 0]])
    # at 0.7 only the 0.9 is predicted: recall 1/2
    assert multilabel_metrics(probs, targets, 0.7)["micro_recall"] == 0.5
    assert multilabel_metrics(probs.astype(np.float64), targets, 0.7)["micro_recall"] == 0.5
    assert choose_threshold(probs, targets, [0.7, 0.8]) == 0.7  # both miss the 0.69999..., the closer one wins
    assert choose_threshold(probs, targets, [0.7, 0.6999]) == 0.6999


def test_multilabel_metrics_summary_is_json_serialisable(data):
    probs, targets = data
    m = multilabel_metrics(probs, targets, 0.45)
    assert set(m) == {"map", "per_class_ap", "micro_f1", "macro_f1", "micro_precision", "micro_recall", "threshold"}
    json.dumps(m, allow_nan=False)  # no NaN, no NumPy scalars
    assert m["per_class_ap"][NO_POSITIVE] is None
    expected_ap = _sklearn_ap(probs, targets)
    for c, ap in enumerate(m["per_class_ap"]):
        if c != NO_POSITIVE:
            assert type(ap) is float and ap == pytest.approx(expected_ap[c], abs=1e-12)
    assert m["map"] == pytest.approx(np.nanmean(expected_ap), abs=1e-12)
    f1 = f1_scores(probs >= 0.45, targets)
    assert {k: m[k] for k in ("micro_f1", "macro_f1", "micro_precision", "micro_recall")} == {
        k: f1[k] for k in ("micro_f1", "macro_f1", "micro_precision", "micro_recall")}
    assert m["micro_f1"] == pytest.approx(f1_score(targets, probs >= 0.45, average="micro"), abs=1e-12)
    assert m["threshold"] == 0.45 and type(m["threshold"]) is float


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        average_precision(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        average_precision(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match="NaN"):
        average_precision(np.array([[np.nan], [0.1]]), np.array([[1], [0]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        average_precision(np.zeros((2, 1)), np.array([[2], [0]]))
