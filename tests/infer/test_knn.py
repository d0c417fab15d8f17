"""k-NN on frozen features (vitflow.infer.features.knn): the weighted vote against a hand computation and a
brute-force numpy reference of DINO's eval_knn protocol."""

import math

import numpy as np
import pytest
import torch

from vitflow.infer.features.knn import TEMPERATURE, knn_scores, knn_top1


def reference_scores(bank, labels, queries, k, t, c):
    """DINO's knn_classifier written out per query in numpy: normalise, cosine, k largest, exp(sim/T) votes."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    out = np.zeros((len(queries), c))
    for i, q in enumerate(queries):
        sim = bank @ (q / np.linalg.norm(q))
        for j in np.argsort(-sim, kind="stable")[:k]:
            out[i, labels[j]] += math.exp(sim[j] / t)
    return out


def test_vote_equals_a_hand_computation():
    # bank on the unit circle at 0, 60, 90 and 180 degrees; the query at 0 degrees (scaled: normalised inside)
    bank = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2], [0.0, 3.0], [-2.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    query = torch.tensor([[5.0, 0.0]])
    # k=3: neighbours at cos 1 (class 0), cos 0.5 (class 1), cos 0 (class 1); T = 0.07
    scores = knn_scores(bank, labels, query, k=3, temperature=0.07)
    assert scores[0, 0].item() == pytest.approx(math.exp(1 / 0.07), rel=1e-5)
    assert scores[0, 1].item() == pytest.approx(math.exp(0.5 / 0.07) + math.exp(0.0), rel=1e-5)
    # a high temperature flattens the weights: two class-1 neighbours now outvote one class-0 neighbour
    flat = knn_scores(bank, labels, query, k=3, temperature=100.0)
    assert flat[0, 1].item() == pytest.approx(math.exp(0.005) + 1.0, rel=1e-6) and flat.argmax().item() == 1
    assert knn_top1(bank, labels, query, torch.tensor([0]), k=3) == 1.0
    assert knn_top1(bank, labels, query, torch.tensor([0]), k=3, temperature=100.0) == 0.0


def test_matches_a_brute_force_reference_on_random_features():
    rng = np.random.default_rng(0)
    c, d = 7, 16
    centers = rng.normal(size=(c, d))
    labels = rng.integers(0, c, 300)
    bank = centers[labels] + rng.normal(scale=1.5, size=(300, d))
    q_labels = rng.integers(0, c, 50)
    queries = centers[q_labels] + rng.normal(scale=1.5, size=(50, d))
    t = torch.from_numpy
    for k in (1, 20, 300, 1000):  # 1000: capped at the bank's 300
        want = reference_scores(bank, labels, queries, min(k, 300), TEMPERATURE, c)
        got = knn_scores(t(bank).float(), t(labels), t(queries).float(), k=k, num_classes=c, chunk=7).double().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4)
        top1 = knn_top1(t(bank).float(), t(labels), t(queries).float(), t(q_labels), k=k, num_classes=c)
        assert top1 == pytest.approx(float((want.argmax(1) == q_labels).mean()))
    assert 0.3 < top1 < 1.0  # a real, non-trivial classification (chance 1/7)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="non-empty memory bank"):
        knn_scores(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="do not fit"):
        knn_scores(torch.ones(3, 4), torch.zeros(3, dtype=torch.long), torch.ones(2, 5))
