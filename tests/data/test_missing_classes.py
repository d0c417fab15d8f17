"""A class missing from a validation or test split (its folder absent or empty, its label absent
from a label file) is a warning naming the split and the classes; macro averages and per-class
tables count only the classes present (scikit-learn with ``labels=`` those) and say which were
absent; the same split given twice is evaluated once, under both names, with a note."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support, precision_score, recall_score

from helpers import make_folder, write_csv
from vitflow.cli import main
from vitflow.config import DataConfig
from vitflow.data import DataError, open_split
from vitflow.metrics.classification import confusion_metrics, per_class_text
from vitflow.metrics.multilabel import f1_scores
from vitflow.rundir import read_metrics
from vitflow.training.track import evaluator

CLASSES = ["ants", "bees", "wasps"]


def _data(root, val_classes=("ants", "bees"), empty=()):
    make_folder(root, classes=CLASSES, per_class=6, split="train")
    make_folder(root, classes=val_classes, per_class=3, split="val", seed=1)
    for c in empty:
        (root / "val" / c).mkdir(parents=True)
    return root


def _warning(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no images of" in r.getMessage()]


@pytest.mark.parametrize("how", ["folder absent", "folder empty", "label absent from the label file"])
def test_a_held_out_split_without_a_class_warns_naming_the_split_and_the_class(tmp_path, caplog, how):
    root = _data(tmp_path / "d", empty=("wasps",) if how == "folder empty" else ())
    path, cfg = root, DataConfig()
    if how.startswith("label"):
        rows = [{"path": p.relative_to(root).as_posix(), "label": p.parent.name, "split": p.parts[-3]}
                for p in sorted(root.rglob("*.png"))]
        path = write_csv(root / "labels.csv", rows)
    with caplog.at_level(logging.WARNING):
        val = open_split(path, "val", classes=CLASSES, cfg=cfg)
    assert len(val) == 6 and val.classes == CLASSES
    (msg,) = _warning(caplog)
    assert msg.startswith("split 'val' of ") and "has no images of 1 of the 3 classes (wasps)" in msg
    assert msg.endswith("its macro averages and per-class tables count only the classes present (2 of 3)")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        open_split(path, "train", classes=CLASSES, cfg=cfg)
    assert _warning(caplog) == []



def test_a_training_slice_without_a_class_warns_that_the_model_never_sees_it(tmp_path, caplog):
    """A slice of the split that defines the classes (the plan's held-out ``train[:-K]`` on class
    folders alone) can leave a class of one or two images out of training: one warning naming it."""
    root = _data(tmp_path / "d")
    with caplog.at_level(logging.WARNING):
        few = open_split(root, "train[:1]")  # one image: two of the three classes absent
    assert len(few) == 1 and few.classes == CLASSES
    (msg,) = _warning(caplog)
    assert msg.startswith("split 'train[:1]' of ") and "has no images of 2 of the 3 classes" in msg
    assert msg.endswith("a model trained on it never sees them (too few images of them to slice: give them more, "
                        "or name the splits)")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        open_split(root, "train[:-2]")  # 16 of 18: every class kept
    assert _warning(caplog) == []

def test_an_empty_class_folder_of_the_training_split_stays_an_error(tmp_path):
    root = _data(tmp_path / "d")
    (root / "train" / "hornets").mkdir()
    with pytest.raises(DataError, match="class folder.s. with no images in .*hornets"):
        open_split(root, "train")


def test_macro_averages_count_only_the_classes_present_as_sklearn_with_labels():
    """4 classes, class 2 absent from the targets but predicted: the issue's case (macro recall
    below balanced accuracy) is gone, every figure is sklearn's with labels= the present classes."""
    rng = np.random.default_rng(0)
    y = rng.choice([0, 1, 3], size=120)
    pred = np.where(rng.random(120) < 0.5, y, rng.choice(4, size=120))
    assert 2 in pred and 2 not in y
    r = confusion_metrics(confusion_matrix(y, pred, labels=range(4)))
    present = [0, 1, 3]
    for avg in ("macro", "weighted"):
        p, rc, f, _ = precision_recall_fscore_support(y, pred, labels=present, average=avg, zero_division=0)
        assert (r[f"{avg}_precision"], r[f"{avg}_recall"], r[f"{avg}_f1"]) == pytest.approx((p, rc, f), abs=1e-15)
    p, rc, f, s = precision_recall_fscore_support(y, pred, labels=present, zero_division=0)
    np.testing.assert_allclose(np.array(r["f1"])[present], f, rtol=0, atol=1e-15)
    assert r["absent"] == [2] and r["macro_recall"] == pytest.approx(r["balanced_accuracy"], abs=1e-15)
    text = per_class_text(["a", "b", "c", "d"], {**r, "ece": 0.0, "reliability": {"count": [0] * 15}})
    assert [line.split()[0] for line in text.splitlines()[1:4]] == ["a", "b", "d"]
    assert text.splitlines()[-1] == "absent from this split, left out of the table and the macro averages: c"


def test_multilabel_macro_averages_count_only_the_labels_present():
    rng = np.random.default_rng(1)
    targets = (rng.random((50, 5)) < 0.3).astype(np.uint8)
    targets[:, 3] = 0  # no example of label 3
    predicted = rng.random((50, 5)) < 0.35
    r = f1_scores(predicted, targets)
    present = [0, 1, 2, 4]
    for name, fn in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
        assert r[f"macro_{name}"] == pytest.approx(fn(targets, predicted, labels=present, average="macro",
                                                      zero_division=0), abs=1e-15)
        assert r[f"micro_{name}"] == pytest.approx(fn(targets, predicted, average="micro", zero_division=0), abs=1e-15)


def test_the_same_split_given_twice_is_evaluated_once_under_both_names(tmp_path, monkeypatch, caplog, capsys):
    root = _data(tmp_path / "d")
    passes = []
    real = evaluator.RunEvaluator._evaluate
    monkeypatch.setattr(evaluator.RunEvaluator, "_evaluate", lambda self, m, s, role: passes.append(role) or real(
        self, m, s, role))
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--json", "--preset", "digits-vit-tiny", "data.source=auto", "model.img_size=8", f"data.path={root}", "data.test_split=val",
                     "train.total_steps=2", "train.batch_size=6", "train.precision=fp32", "train.live_report=false",
                     f"train.run_dir={run}"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert passes == ["val"]  # one pass, at the end
    assert "data.test_split=val is the validation split itself: it is evaluated once and reported as both val " \
           "and test" in caplog.text
    assert len(_warning(caplog)) == 1  # the split opened once
    assert summary["val_top1"] == summary["test_top1"] and summary["val_macro_f1"] == summary["test_macro_f1"]
    assert sorted(r["split"] for r in read_metrics(run) if r["kind"] == "eval") == ["test", "val"]
    ev = json.loads((run / "eval.json").read_text())
    assert ev["absent"] == [2] and len(ev["f1"]) == 3
    assert ev["macro_recall"] == pytest.approx(ev["balanced_accuracy"], abs=1e-12)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # vitflow eval on that split: the same warning and the absent class named
        assert main(["eval", str(run)]) == 0
    assert len(_warning(caplog)) == 1
    assert ("absent from this split, left out of the table and the macro averages: wasps"
            in capsys.readouterr().out.strip().splitlines())
