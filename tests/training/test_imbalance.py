"""Imbalanced data: balanced class weights against scikit-learn, the weighted losses against hand
computations, weight files and their errors, the class-balanced sampler (uniform classes,
deterministic, resumable, sharded), a mid-epoch resume with both bit for bit, the report's class
distribution panel."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.utils.class_weight import compute_class_weight

from helpers import make_folder
from vitflow import checkpoint as ckpt
from vitflow.config import ConfigError, build_config
from vitflow.data.loader import BalancedSampler, EpochSampler, class_counts
from vitflow.training import train
from vitflow.training.objectives.class_weights import apply_class_weights, read_weight_file, resolve_class_weights
from vitflow.training.objectives.distill import LabelLoss, MultiLabelLoss

LABELS = np.array([0] * 50 + [1] * 5 + [2] * 20 + [3] * 1)
CLASSES = ["a", "b", "c", "d"]


def test_balanced_weights_equal_scikit_learn():
    w = resolve_class_weights("balanced", LABELS, CLASSES)
    ref = compute_class_weight("balanced", classes=np.arange(4), y=LABELS)
    assert torch.allclose(w, torch.tensor(ref, dtype=torch.float32))
    assert abs(float(w[torch.from_numpy(LABELS)].mean()) - 1) < 1e-6  # unit mean weight over the images
    assert resolve_class_weights("none", LABELS, CLASSES) is None


def test_weighted_losses_equal_the_hand_computed_ones():
    torch.manual_seed(0)
    logits, y = torch.randn(6, 4), torch.tensor([0, 1, 1, 3, 2, 0])
    w = resolve_class_weights("balanced", LABELS, CLASSES)
    loss = LabelLoss(0.0)
    apply_class_weights(loss, w)
    nll = -F.log_softmax(logits, -1)[torch.arange(6), y]
    assert torch.allclose(loss(logits, y, None), (w[y] * nll).sum() / w[y].sum())
    assert torch.allclose(loss(logits, y, None), F.cross_entropy(logits, y, weight=w))
    smooth = LabelLoss(0.1)
    apply_class_weights(smooth, w)
    assert torch.allclose(smooth(logits, y, None), F.cross_entropy(logits, y, weight=w, label_smoothing=0.1))
    soft = torch.softmax(torch.randn(6, 4), -1)  # Mixup/CutMix targets: each class term scaled, mean over B
    t = 0.9 * soft + 0.1 / 4
    want = -(w * t * F.log_softmax(logits, -1)).sum(-1).mean()
    assert torch.allclose(smooth(logits, soft, None), want, atol=1e-6)
    assert not torch.allclose(LabelLoss(0.1)(logits, soft, None), want)  # the weights change the loss

    multi = (torch.rand(6, 4) > 0.6).float()
    pos = resolve_class_weights("balanced", multi.numpy().astype(np.uint8), CLASSES, "multilabel")
    p = multi.sum(0)
    assert torch.allclose(pos, torch.where(p > 0, (6 - p) / p.clamp(min=1), torch.ones(4)))
    bce = MultiLabelLoss("bce")
    apply_class_weights(bce, pos, "multilabel")
    ref = -(pos * multi * F.logsigmoid(logits) + (1 - multi) * F.logsigmoid(-logits)).mean()
    assert torch.allclose(bce(logits, multi, None), ref, atol=1e-6)
    with pytest.raises(ConfigError, match="train.loss=bce"):
        apply_class_weights(MultiLabelLoss("asl"), pos, "multilabel")


def test_weight_files_and_their_errors(tmp_path):
    (tmp_path / "w.json").write_text(json.dumps([1, 2, 3.5, 0]))
    (tmp_path / "d.json").write_text(json.dumps({"d": 4, "c": 3, "b": 2, "a": 1}))
    (tmp_path / "w.txt").write_text("# per class\n1\n2\n\n3\n4  # rare\n")
    assert resolve_class_weights(str(tmp_path / "w.json"), LABELS, CLASSES).tolist() == [1, 2, 3.5, 0]
    assert read_weight_file(tmp_path / "d.json", CLASSES) == [1, 2, 3, 4]
    assert read_weight_file(tmp_path / "w.txt", CLASSES) == [1, 2, 3, 4]
    (tmp_path / "short.txt").write_text("1\n2\n")
    with pytest.raises(ConfigError, match=r"short.txt has 2 weights for 4 classes"):
        read_weight_file(tmp_path / "short.txt", CLASSES)
    (tmp_path / "bad.json").write_text('{"a": 1, "zz": 2}')
    with pytest.raises(ConfigError, match=r"bad.json names unknown classes \['zz'\]"):
        read_weight_file(tmp_path / "bad.json", CLASSES)
    (tmp_path / "neg.txt").write_text("1\n-2\n1\n1\n")
    with pytest.raises(ConfigError, match="neg.txt has a weight that is not a finite number >= 0"):
        read_weight_file(tmp_path / "neg.txt", CLASSES)
    with pytest.raises(ConfigError, match="train.class_weights='nope.json' is invalid"):
        build_config(overrides=["train.class_weights=nope.json"])
    with pytest.raises(ConfigError, match="data.sampler"):
        build_config(overrides=["data.sampler=balanced", "data.task=multilabel"])


def test_balanced_sampler_draws_classes_uniformly_deterministically_and_resumably():
    labels = np.array([0] * 2700 + [1] * 270 + [2] * 30)
    s = BalancedSampler(labels, batch_size=100, seed=3)
    for epoch in range(3):
        counts = np.bincount(labels[s.order(epoch)], minlength=3)
        assert counts.sum() == 3000 and np.abs(counts - 1000).max() < 120, counts  # sd ~26 per class
        chi2 = ((counts - 1000) ** 2 / 1000).sum()
        assert chi2 < 13.8  # chi-square, 2 d.o.f., p = 0.001
    plain = np.bincount(labels[EpochSampler(3000, 100, True, True, seed=3).order(0)], minlength=3)
    assert plain.tolist() == [2700, 270, 30]
    assert np.array_equal(s.order(1), BalancedSampler(labels, 100, seed=3).order(1))
    assert not np.array_equal(s.order(1), s.order(2)) and not np.array_equal(s.order(1), BalancedSampler(
        labels, 100, seed=4).order(1))
    full = [r.indices for r, _ in zip(iter(s), range(75))]  # 30 batches per epoch: 2.5 epochs
    resumed = [r.indices for r, _ in zip(iter(BalancedSampler(labels, 100, seed=3, start=(1, 12))), range(33))]
    assert all(np.array_equal(a, b) for a, b in zip(full[42:], resumed))
    ranks = [BalancedSampler(labels, 100, seed=3, rank=r, world_size=2).order(0) for r in range(2)]
    assert np.array_equal(np.stack(ranks, 1).reshape(-1), s.order(0))  # the ranks share one epoch's draws
    assert class_counts(labels, 4) == [2700, 270, 30, 0]


def _imbalanced_folder(tmp_path):
    data = make_folder(tmp_path / "data", per_class=16, size=8)
    for p in sorted((data / "c").glob("*.png"))[4:]:
        p.unlink()  # a: 16, b: 16, c: 4 images
    return data


def _config(run_dir, data, *extra):
    return build_config(overrides=[f"data.path={data}", "data.source=folder", "data.train_split=train[:80%]",
                                   "data.test_split=train[80%:]", "data.hflip=true", "data.sampler=balanced",
                                   "train.class_weights=balanced", "model.img_size=8", "train.batch_size=8",
                                   "train.total_steps=6", "train.checkpoint_every=4", "train.keep_checkpoints=10",
                                   "train.precision=fp32", "train.log_every=2", f"train.run_dir={run_dir}", *extra])


def test_mid_epoch_resume_with_balanced_sampler_and_weights_is_bitwise(tmp_path, caplog):
    data = _imbalanced_folder(tmp_path)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    with caplog.at_level("INFO", logger="vitflow"):
        train(_config(full, data))
    assert "class weights balanced (min" in caplog.text and "sampler balanced" in caplog.text
    assert ckpt.load_checkpoint(ckpt.checkpoint_path(full, 4))["data"]["position"][1] != 0  # mid-epoch
    shutil.copytree(full, resumed)
    ckpt.checkpoint_path(resumed, 6).unlink()
    train(_config(resumed, data, "train.resume=auto"))
    a, b = ckpt.load_checkpoint(ckpt.checkpoint_path(full, 6)), ckpt.load_checkpoint(ckpt.checkpoint_path(resumed, 6))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    dist = json.loads((full / "class_counts.json").read_text())
    assert dist["classes"] == ["a", "b", "c"] and set(dist["splits"]) == {"train", "test"}
    together = np.add(dist["splits"]["train"]["counts"], dist["splits"]["test"]["counts"])
    assert together.tolist() == [16, 16, 4] and dist["splits"]["test"]["split"] == "train[80%:]"

    from vitflow.viz.report import write_report
    page = write_report(full).read_text()
    assert "<h2>Class distribution</h2>" in page and "Imbalance (largest / smallest class): train" in page
