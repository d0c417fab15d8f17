"""Multi-label classification end to end on real pixels: 2x2 mosaics of four CIFAR-10 images,
labelled with the set of their tiles' classes, train to a mAP well above the label-frequency
baseline; evaluation, prediction, the report, the ONNX export and the INT8 model carry the task and
the threshold chosen on the validation split."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cifar_mosaics, digits_config
from vitflow.checkpoint import load_checkpoint
from vitflow.cli import main
from vitflow.infer import collect_images
from vitflow.infer.evaluate import evaluate_checkpoint
from vitflow.infer.predict import Predictor
from vitflow.training import train

# a small ViT (64 tokens of width 96, 4 blocks) on 64x64 mosaics: ~45 s of training on 2 cores
RECIPE = ("data.source=auto", "data.train_split=train", "data.val_split=auto", "data.test_split=auto",
          "data.task=multilabel", "model.name=vit_cifar_patch4_32", "model.img_size=64", "model.patch_size=8",
          "model.embed_dim=96", "model.depth=4", "model.num_heads=3", "model.global_pool=avg",
          "model.pos_embed=sincos2d", "data.train_augment=pad_crop", "data.padding=4", "data.hflip=true",
          "data.crop_pct=1.0", "data.mean=[0.5,0.5,0.5]", "data.std=[0.25,0.25,0.25]", "train.total_steps=200",
          "train.batch_size=64", "train.eval_every=100", "optim.lr=4e-3", "optim.warmup_steps=20",
          "train.precision=fp32")


def label_sets(labels_csv: Path, split: str) -> list[set[str]]:
    with open(labels_csv, newline="") as f:
        return [set(r["labels"].split(";")) for r in csv.DictReader(f) if r["split"] == split]


@pytest.fixture(scope="module")
def mosaic_run(tmp_path_factory):
    """``(labels.csv, run summary, checkpoint)`` of one training run on 1,200 / 300 / 300 mosaics."""
    root = tmp_path_factory.mktemp("mosaics")
    labels = cifar_mosaics(root / "data")
    summary = train(digits_config(root / "run", f"data.path={labels}", *RECIPE))
    return labels, summary, load_checkpoint(summary["checkpoint"])


@pytest.mark.slow
def test_mosaics_train_to_a_map_well_above_the_label_frequency_baseline(mosaic_run):
    labels, summary, state = mosaic_run
    test = label_sets(labels, "test")
    classes = sorted(set().union(*test))
    # a constant score per class ranks every image alike: its AP is the class's frequency
    baseline = float(np.mean([np.mean([c in s for s in test]) for c in classes]))
    assert 0.30 < baseline < 0.38  # four tiles of ten classes: 1 - 0.9^4 = 0.34 per class
    assert summary["test_map"] > baseline + 0.08, (summary["test_map"], baseline)  # measured: 0.48 vs 0.34
    assert summary["val_map"] > baseline + 0.05
    assert state["task"] == "multilabel" and 0 < state["threshold"] < 1
    assert summary["test_threshold"] == summary["val_threshold"] == state["threshold"]
    ev = json.loads((Path(summary["run_dir"]) / "eval.json").read_text())
    assert ev["task"] == "multilabel" and ev["split"] == "test" and len(ev["per_class_ap"]) == 10
    assert ev["map"] == pytest.approx(np.mean(ev["per_class_ap"]), abs=1e-12) == summary["test_map"]


def test_eval_scores_the_test_split_at_the_saved_threshold(mosaic_run):
    labels, summary, state = mosaic_run
    r = evaluate_checkpoint(summary["checkpoint"], ["data.eval_batch_size=64"], device="cpu")
    assert r["split"] == "test" and r["test_threshold"] == state["threshold"]
    assert r["test_map"] == pytest.approx(summary["test_map"], abs=1e-6)
    assert r["test_micro_f1"] == pytest.approx(summary["test_micro_f1"], abs=1e-6)


def test_predict_lists_every_label_over_the_threshold(mosaic_run):
    labels, summary, state = mosaic_run
    predictor = Predictor.from_checkpoint(summary["checkpoint"], device="cpu")
    assert predictor.task == "multilabel" and predictor.threshold == state["threshold"]
    refs = collect_images([labels.parent / "test"])[:16]
    results = list(predictor.predict_refs(refs, topk=3, batch_size=8, workers=1))
    probs = predictor.predict(torch.stack([predictor.transform(predictor._decode(r)) for r in refs]))
    for r, p in zip(results, probs):
        over = {predictor.classes[i] for i in range(len(p)) if p[i] >= predictor.threshold}
        assert {e["class"] for e in r["labels"]} == over
        assert [e["prob"] for e in r["labels"]] == sorted((e["prob"] for e in r["labels"]), reverse=True)
        assert len(r["top"]) == 3 and all(0 <= e["prob"] <= 1 for e in r["top"])
    assert any(len(r["labels"]) > 1 for r in results)  # a mosaic holds several classes


def test_report_shows_map_and_per_class_ap(mosaic_run):
    from vitflow.viz.report import write_report

    _, summary, _ = mosaic_run
    page = write_report(summary["run_dir"]).read_text()
    assert "test mAP" in page and "val mAP" in page and "Per-class average precision" in page
    assert "chosen on the validation split" in page


def test_onnx_export_and_int8_carry_the_task_and_threshold(mosaic_run, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    from vitflow.infer.runtimes.onnx import OnnxModel

    labels, summary, state = mosaic_run
    onnx_path, int8_path = tmp_path / "model.onnx", tmp_path / "model-int8.onnx"
    assert main(["export", summary["checkpoint"], "-o", str(onnx_path)]) == 0
    assert main(["quantize", str(onnx_path), "-o", str(int8_path), "--data", str(labels), "--split", "test",
                 "--max-drop", "5", "--json"]) == 0
    q = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"map_before", "map_after", "drop_points"} <= set(q) and q["drop_points"] <= 5
    assert q["map_before"] == pytest.approx(summary["test_map"], abs=1e-4)  # the fp32 ONNX scores as the run did
    for path in (onnx_path, int8_path):
        info = OnnxModel(path).info()
        assert info.task == "multilabel" and info.threshold == state["threshold"]
    onnx = Predictor.from_onnx(onnx_path)
    torch_ = Predictor.from_checkpoint(summary["checkpoint"], device="cpu")
    refs = collect_images([labels.parent / "test"])[:8]
    x = torch.stack([torch_.transform(torch_._decode(r)) for r in refs])
    assert torch.allclose(onnx.predict(x), torch_.predict(x), atol=1e-4)  # sigmoid probabilities, not softmax
