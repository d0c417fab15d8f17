"""A 10:1 imbalanced CIFAR-10 subset cut from the shared JPEG tar (benchmarks/training/imbalance.py's builder):
its class counts, the balanced sampler on its real labels, and the benchmark's balanced accuracy
against scikit-learn's."""

import importlib.util

import numpy as np
from sklearn.metrics import balanced_accuracy_score, confusion_matrix

from helpers import CIFAR_TAR, ROOT, need
from vitflow.data import open_split
from vitflow.data.loader import BalancedSampler, class_counts


def _bench():
    spec = importlib.util.spec_from_file_location("imbalance_bench", ROOT / "benchmarks" / "training" / "imbalance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cifar_subset_is_10_to_1_and_the_balanced_sampler_evens_it(tmp_path):
    bench = _bench()
    data = bench.build_subset(need(CIFAR_TAR), tmp_path / "c10", ["cat", "dog"], [100, 10], 4)
    train = open_split(data, "train")
    assert train.classes == ["cat", "dog"] and class_counts(train.labels, 2) == [100, 10]
    assert class_counts(open_split(data, "test", classes=train.classes).labels, 2) == [4, 4]
    s = BalancedSampler(train.labels, 10, seed=0)
    drawn = np.concatenate([train.labels[s.order(e)] for e in range(20)])  # 2,200 draws
    assert abs(np.mean(drawn == 1) - 0.5) < 0.05  # the rare class half the time (it is 9% of the images)

    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    assert abs(bench.balanced_accuracy(confusion_matrix(y, p).tolist()) - balanced_accuracy_score(y, p)) < 1e-12
