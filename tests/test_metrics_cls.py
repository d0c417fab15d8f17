"""Single-label metrics against scikit-learn, the ECE against a hand-computed case, and a 2-process
(gloo) evaluation equal to the 1-process one."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, confusion_matrix, precision_recall_fscore_support

from vitflow.metrics.classification import CONFIDENCE_SCALE, calibration, calibration_counts, confusion_metrics


def test_precision_recall_f1_balanced_accuracy_equal_sklearn():
    """5 classes: class 3 is never predicted, class 4 never occurs in the targets (but is predicted):
    the per-class figures are sklearn's over all classes, the macro averages over the classes present."""
    rng = np.random.default_rng(0)
    y = rng.choice([0, 1, 2, 3], size=200, p=[0.5, 0.25, 0.15, 0.1])
    pred = np.where(rng.random(200) < 0.6, y, rng.choice([0, 1, 2, 4], size=200))
    pred[pred == 3] = 4
    assert 3 not in pred and 4 not in y
    labels = list(range(5))
    r = confusion_metrics(confusion_matrix(y, pred, labels=labels))
    p, rc, f, s = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    np.testing.assert_allclose(r["precision"], p, rtol=0, atol=1e-15)
    np.testing.assert_allclose(r["recall"], rc, rtol=0, atol=1e-15)
    np.testing.assert_allclose(r["f1"], f, rtol=0, atol=1e-15)
    assert r["support"] == s.tolist()
    for avg in ("macro", "weighted"):
        p, rc, f, _ = precision_recall_fscore_support(y, pred, labels=[0, 1, 2, 3], average=avg, zero_division=0)
        assert (r[f"{avg}_precision"], r[f"{avg}_recall"], r[f"{avg}_f1"]) == pytest.approx((p, rc, f), abs=1e-15)
    assert r["absent"] == [4]
    with pytest.warns(UserWarning):  # sklearn warns about class 4, predicted but absent; the value is the reference
        expected = balanced_accuracy_score(y, pred)
    assert r["balanced_accuracy"] == pytest.approx(expected, abs=1e-15)
    assert r["precision"][3] == 0.0 and r["recall"][4] == 0.0 and r["support"][4] == 0


def test_ece_of_a_hand_computed_case():
    """4 images, 2 classes, M = 15 bins. Confidences 0.9, 0.9 (one right, one wrong) fall in bin
    (13/15, 14/15]; 0.65 (right) in (9/15, 10/15]; 0.75 (wrong) in (11/15, 12/15].
    ECE = 2/4 |0.5 - 0.9| + 1/4 |1 - 0.65| + 1/4 |0 - 0.75| = 0.2 + 0.0875 + 0.1875 = 0.475."""
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.35, 0.65], [0.25, 0.75]], dtype=torch.float64)
    logits = probs.log()
    labels = torch.tensor([0, 1, 1, 0])
    counts = calibration_counts(logits, labels)
    r = calibration(counts)
    assert r["ece"] == pytest.approx(0.475, abs=1e-6)
    rel = r["reliability"]
    assert rel["count"][13] == 2 and rel["count"][9] == 1 and rel["count"][11] == 1 and sum(rel["count"]) == 4
    assert rel["accuracy"][13] == 0.5 and rel["confidence"][13] == pytest.approx(0.9, abs=1e-6)
    assert rel["accuracy"][0] is None and len(rel["bins"]) == 16 and rel["bins"][-1] == 1.0
    assert int(counts[2].sum()) == pytest.approx(3.2 * CONFIDENCE_SCALE, rel=1e-6)


def test_ece_edges_follow_guo_bins():
    """Bins are (m/15, (m+1)/15]: 0.5 falls in bin 7, a confidence of 1.0 in the last bin."""
    conf = torch.tensor([1.0, 0.5])  # two classes: probabilities (1, 0) and (0.5, 0.5)
    logits = torch.stack([torch.log(conf), torch.log1p(-conf)], dim=1)
    counts = calibration_counts(logits, torch.tensor([0, 0]))
    assert counts[0].tolist() == [0] * 7 + [1] + [0] * 6 + [1]  # 0.5 in (7/15, 8/15], 1.0 in (14/15, 1]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from vitflow.data import SkipReport, eval_loader
    from vitflow.data.sources.digits import digits_source
    from vitflow.data.transforms import Preprocess
    from vitflow.evaluation import evaluate
    from vitflow.models import create_model
    from vitflow.runtime import resolve_precision

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = create_model("vit_digits_patch2_8", num_classes=10)
    source = digits_source()
    source = source.subset(np.arange(301)[rank::world])  # an odd count: the ranks' shares differ, none padded
    pp = Preprocess(8, 1.0, "bilinear", (0.5,) * 3, (0.5,) * 3)
    loader = eval_loader(source, pp, 64, 0)

    def reduce(t):
        dist.all_reduce(t)
        return t
    r = evaluate(model, loader, torch.device("cpu"), resolve_precision("fp32", torch.device("cpu")), pp, SkipReport(),
                 reduce, 10)
    if rank == 0:
        torch.save(r, out)
    dist.destroy_process_group()


def test_two_process_evaluation_equals_one_process(tmp_path):
    import torch.multiprocessing as mp

    from vitflow.data import SkipReport, eval_loader
    from vitflow.data.sources.digits import digits_source
    from vitflow.data.transforms import Preprocess
    from vitflow.evaluation import evaluate
    from vitflow.models import create_model
    from vitflow.runtime import resolve_precision

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.pt"
    mp.start_processes(_rank, args=(2, port, str(out)), nprocs=2, join=True, start_method="fork")  # no re-import
    two = torch.load(out, weights_only=False)
    torch.manual_seed(0)
    model = create_model("vit_digits_patch2_8", num_classes=10)
    pp = Preprocess(8, 1.0, "bilinear", (0.5,) * 3, (0.5,) * 3)
    loader = eval_loader(digits_source().subset(np.arange(301)), pp, 64, 0)
    one = evaluate(model, loader, torch.device("cpu"), resolve_precision("fp32", torch.device("cpu")), pp, SkipReport(),
                   None, 10)
    assert two["images"] == one["images"] == 301
    for key in ("confusion", "precision", "recall", "f1", "support", "macro_f1", "weighted_f1", "balanced_accuracy",
                "ece", "reliability", "top1", "top5"):
        assert two[key] == one[key], key  # exactly: integer sums
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
