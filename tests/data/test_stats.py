"""Dataset statistics (``vitflow prepare --stats``, ``data.normalize=dataset``): the figures equal a
float64 reference over the same images; they are stored beside the data keyed by the split's
content fingerprint (or in the cache folder when the data's folder is read-only), found again
without a second pass, and a run trained with them exports and predicts with them."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import CIFAR_TAR, digits_config, make_folder, need, snapshot
from vitflow.config import ConfigError, DataConfig
from vitflow.data import open_split
from vitflow.data.stats import measure, split_fingerprint
from vitflow.data.stats.store import SIDECAR, cache_path, dataset_normalization, measure_split


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    """The cache folder of the statistics (and nothing else) inside the test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _reference(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """float64 per-channel mean and population std over all pixels of ``(H, W, 3)`` uint8 arrays."""
    pixels = np.concatenate([a.reshape(-1, 3) for a in arrays]).astype(np.float64) / 255.0
    return pixels.mean(0), pixels.std(0)


def _photo_folder(root: Path) -> Path:
    """train/<class>/ PNGs of different sizes and modes (RGB, grayscale, RGBA), decoded
    independently below with Pillow."""
    rng = np.random.default_rng(3)
    for i, (h, w, mode) in enumerate([(31, 17, "RGB"), (64, 48, "RGB"), (9, 90, "L"), (40, 40, "RGBA"),
                                      (128, 96, "RGB"), (5, 7, "RGB")]):
        channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
        arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        arr[..., 0] //= 2  # channels of different means
        folder = root / "train" / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode).save(folder / f"{i}.png")
    return root


def test_stats_equal_a_float64_reference_over_the_same_images(tmp_path):
    root = _photo_folder(tmp_path / "photos")
    files = sorted((root / "train").rglob("*.png"))
    mean, std = _reference([np.asarray(Image.open(f).convert("RGB")) for f in files])
    stats, fingerprint, file = measure_split(DataConfig(path=str(root)), workers=2)
    assert np.abs(np.array(stats.mean) - mean).max() < 1e-6 and np.abs(np.array(stats.std) - std).max() < 1e-6
    assert (stats.images, stats.skipped, stats.sample) == (6, 0, None)
    assert stats.pixels == sum(Image.open(f).size[0] * Image.open(f).size[1] for f in files)
    assert file == root / SIDECAR  # inside the folder, hidden
    entry = json.loads(file.read_text())["splits"][fingerprint]
    assert entry["mean"] == list(stats.mean) and entry["split"] == "train" and entry["data"] == str(root)


def test_real_cifar_slice_and_a_sample_of_it(tmp_path):
    source = open_split(need(CIFAR_TAR), "train[:400]")
    mean, std = _reference([source.load(i).permute(1, 2, 0).numpy() for i in range(len(source))])
    stats = measure(source, workers=2)
    assert np.abs(np.array(stats.mean) - mean).max() < 1e-6 and np.abs(np.array(stats.std) - std).max() < 1e-6
    assert abs(stats.mean[0] - 0.49) < 0.05  # CIFAR's red channel: a real photo set, not noise
    picked = np.sort(np.random.default_rng(0).choice(400, size=50, replace=False))
    mean50, std50 = _reference([source.load(int(i)).permute(1, 2, 0).numpy() for i in picked])
    sampled = measure(source, sample=50)
    assert (sampled.images, sampled.sample) == (50, 50)
    assert np.abs(np.array(sampled.mean) - mean50).max() < 1e-6 and np.abs(np.array(sampled.std) - std50).max() < 1e-6


def test_stored_stats_are_found_by_fingerprint_and_a_changed_split_is_measured_again(tmp_path, caplog):
    root = make_folder(tmp_path / "imgs", split="train")
    d = DataConfig(path=str(root))
    with caplog.at_level(logging.INFO, logger="vitflow"):
        first = dataset_normalization(d)
    assert "measured in" in caplog.text and d.mean == first.mean and d.std == first.std
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vitflow"):
        again = dataset_normalization(DataConfig(path=str(root)))
    assert again == first and "measured in" not in caplog.text and str(root / SIDECAR) in caplog.text
    old = split_fingerprint(open_split(root, "train"))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "train" / "a" / "new.png")
    new = split_fingerprint(open_split(root, "train"))
    assert new != old
    changed = dataset_normalization(DataConfig(path=str(root)))
    assert changed.images == first.images + 1 and changed.mean[0] < first.mean[0]
    assert len(json.loads((root / SIDECAR).read_text())["splits"]) == 2  # both versions kept, by fingerprint
    copy = tmp_path / "copy"
    os.rename(root, copy)  # the same files elsewhere: the same fingerprint, the sidecar travels with them
    assert split_fingerprint(open_split(copy, "train")) == new
    assert dataset_normalization(DataConfig(path=str(copy))) == changed


def test_read_only_data_and_a_foreign_sidecar_are_left_alone(tmp_path):
    root = make_folder(tmp_path / "ro", split="train")
    (root / SIDECAR).write_text("my notes, not vitflow's\n")
    stats, fingerprint, file = measure_split(DataConfig(path=str(root)))
    assert file == cache_path(fingerprint) and file.is_relative_to(tmp_path / "xdg")
    assert (root / SIDECAR).read_text() == "my notes, not vitflow's\n"
    (root / SIDECAR).unlink()
    before = snapshot(root)
    os.chmod(root, 0o555)  # marked read-only (respected even when the tests run as root)
    try:
        found = dataset_normalization(DataConfig(path=str(root)))
    finally:
        os.chmod(root, 0o755)
    assert found == stats and snapshot(root) == before and not (root / SIDECAR).exists()


def test_mean_set_by_hand_that_disagrees_is_one_clear_error(tmp_path):
    from vitflow.config import build_config

    root = make_folder(tmp_path / "imgs", split="train")
    cfg = build_config(overrides=[f"data.path={root}", "data.source=auto", "data.train_split=train", "data.normalize=dataset",
                                  "data.mean=[0.1,0.2,0.3]"])
    with pytest.raises(ConfigError, match=r"data.mean=\[0.1, 0.2, 0.3\] \(in command line\) disagrees with "
                                          r"data.normalize=dataset, which measured \(0\.\d{4}, "):
        dataset_normalization(cfg.data, cfg.key_origins)
    stats = measure_split(DataConfig(path=str(root)))[0]
    same = build_config(overrides=[f"data.path={root}", "data.source=auto", "data.train_split=train", "data.normalize=dataset",
                                   f"data.mean={list(stats.mean)}"])  # e.g. a saved config.yaml of such a run
    assert dataset_normalization(same.data, same.key_origins) == stats


def test_a_run_with_dataset_normalization_exports_and_predicts_with_those_numbers(tmp_path, capsys):
    import onnx

    from vitflow.checkpoint import latest_checkpoint, load_checkpoint, model_from_checkpoint
    from vitflow.cli import main
    from vitflow.data import model_input
    from vitflow.infer import Predictor
    from vitflow.infer.export.formats import export_checkpoint
    from vitflow.training import train

    root = make_folder(tmp_path / "data", split="train", per_class=6)
    make_folder(tmp_path / "data", split="test", per_class=2, seed=1)
    assert main(["prepare", str(root), "--stats", "--workers", "1"]) == 0
    stats = json.loads((root / SIDECAR).read_text())["splits"].popitem()[1]
    assert f"statistics: {root / SIDECAR}" in capsys.readouterr().out
    run = tmp_path / "run"  # the digits preset's small ViT on the folder; the preset's mean/std (0.5) are replaced
    train(digits_config(run, f"data.path={root}", "data.source=auto", "data.train_split=train",
                        "data.test_split=test", "data.normalize=dataset", "train.total_steps=2", "train.eval_every=0",
                        "train.batch_size=8", "optim.warmup_steps=1"))
    state = load_checkpoint(latest_checkpoint(run))
    assert state["preprocess"]["mean"] == stats["mean"] and state["preprocess"]["std"] == stats["std"]
    assert list(state["config"]["data"]["mean"]) == stats["mean"]  # the run's saved config: a resume keeps them
    onnx_path = tmp_path / "model.onnx"
    assert export_checkpoint(run, onnx_path, log=lambda m: None)["ok"]
    meta = {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
    pp = json.loads(meta["vitflow.preprocess"])
    assert pp["mean"] == stats["mean"] and pp["std"] == stats["std"]
    images = torch.stack([open_split(root, "test").load(i) for i in range(6)])
    with torch.no_grad():
        want = model_from_checkpoint(state)(model_input(images, stats["mean"], stats["std"])).softmax(-1)
    for path in (run, onnx_path):
        predictor = Predictor.load(path, device="cpu")
        assert list(predictor.pp.mean) == stats["mean"] and list(predictor.pp.std) == stats["std"]
        assert torch.allclose(predictor.predict(images), want, atol=1e-5)


def test_a_resumed_run_keeps_the_numbers_it_was_trained_with(tmp_path):
    """Resuming, ``data.normalize=dataset`` takes the checkpoint's saved mean / std (the split is not
    measured again, even if it changed); a new run measures it."""
    from vitflow.config import build_config
    from vitflow.training.normalize import open_run_datasets
    from vitflow.training.scale.distributed import DistEnv

    root = make_folder(tmp_path / "imgs", split="train")
    keys = [f"data.path={root}", "data.source=auto", "data.train_split=train", "data.val_split=train[:4]",
            "data.normalize=dataset"]
    saved = {"config": {"data": {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}}}
    resumed = build_config(overrides=keys)
    open_run_datasets(resumed.data, 8, DistEnv(), saved, resumed.key_origins)
    assert (resumed.data.mean, resumed.data.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert not (root / SIDECAR).exists()
    new = build_config(overrides=keys)
    open_run_datasets(new.data, 8, DistEnv(), None, new.key_origins)
    assert new.data.mean == measure_split(DataConfig(path=str(root)))[0].mean and (root / SIDECAR).exists()
