"""The run planned from the data (``vitflow train data.path=PHOTOS`` with no preset): the choices and
their reasons, the user's keys winning with the values that depend on them following, the size
warnings, and real photo folders (the hymenoptera photos, the ImageNet sample re-labelled into a
few classes through a label file) trained end to end on the batched in-RAM path."""

from __future__ import annotations

import logging
import tarfile
from pathlib import Path

import pytest

from helpers import CIFAR_TAR, HYMENOPTERA_TAR, IMAGENET_TAR, need, write_csv
from vitflow.cli.commands import CONFIG_CHECKS
from vitflow.config import build_config
from vitflow.models import config_class, create_model, model_args
from vitflow.train import train
from vitflow.train.plan import DataProfile, is_planned, plan_overrides, planned_config, resolve_plan, size_warnings

SHORT = ["train.total_steps=3", "train.log_every=1"]  # keys the user sets: the plan leaves them alone


def test_plan_on_a_cpu_keeps_64_tokens_and_scales_the_batch_and_lr_with_the_data():
    plan = {k: v for k, v, _ in plan_overrides(DataProfile(245, 2, 375, 500), "cpu", set())}
    assert plan["model.img_size"] == 64 and plan["model.patch_size"] == 8 and "model.name" not in plan
    assert plan["train.batch_size"] == 32  # the largest power of two with >= 4 batches per epoch
    small = {k: v for k, v, _ in plan_overrides(DataProfile(5000, 10, 32, 32), "cpu", set())}
    assert (small["model.img_size"], small["model.patch_size"], small["train.batch_size"]) == (32, 4, 128)
    gpu = {k: v for k, v, _ in plan_overrides(DataProfile(50_000, 100, 375, 500), "cuda", set())}
    assert (gpu["model.img_size"], gpu["model.patch_size"], gpu["model.name"]) == (224, 16, "vit_small_patch16_224")
    resolved = {k: v for k, v, _ in resolve_plan(plan_overrides(DataProfile(245, 2, 375, 500), "cpu", set()), 32, 245)}
    assert resolved["optim.lr"] == pytest.approx(2e-3 * (32 / 256) ** 0.5, rel=0.01)
    assert resolved["train.total_steps"] == 100 * (245 // 32) and resolved["optim.warmup_steps"] == 35
    assert resolved["train.eval_every"] == resolved["train.checkpoint_every"] == 140
    kept = {k for k, _, _ in plan_overrides(DataProfile(245, 2, 375, 500), "cpu", {"model.img_size"})}
    assert "model.img_size" not in kept and "model.patch_size" in kept  # the user's key is never planned


def test_a_named_swin_keeps_its_own_sizes_and_position_encoding(tmp_path: Path):
    plan = {k: v for k, v, _ in plan_overrides(DataProfile(245, 2, 375, 500), "cpu", {"model.name"}, "swin")}
    assert "model.img_size" not in plan and "model.patch_size" not in plan and plan["model.pos_embed"] == "learned"
    # end to end on the CIFAR JPEG tar: the preset's ViT-only sin-cos positions are not handed to the Swin (its
    # section has no pos_embed), and the model is built with the variant's patch 2 (a 16 x 16 grid), not the plan's 4
    cfg = planned_config(["model.name=swin_cifar_patch2_window4_32", f"data.path={need(CIFAR_TAR)}",
                          f"train.run_dir={tmp_path / 'run'}"], CONFIG_CHECKS)
    assert (cfg.model.img_size, cfg.model.patch_size, hasattr(cfg.model, "pos_embed")) == (None, None, False)
    model = create_model(**model_args(cfg.model, 10))
    assert tuple(model.patch_embed.proj.weight.shape) == (96, 3, 2, 2)


def test_is_planned_only_without_a_preset_or_config_and_with_a_path():
    assert is_planned(None, None, ["data.path=photos"]) and is_planned("photos-auto", None, [])
    assert not is_planned("cifar10-vit-tiny", None, ["data.path=photos"])
    assert not is_planned(None, "run.yaml", ["data.path=photos"]) and not is_planned(None, None, [])
    assert not is_planned(None, None, ["data.path=x", "data.source=digits"])


def test_size_warnings_name_the_tokens_and_the_upsampling():
    cfg = build_config(overrides=["model.img_size=224", "model.patch_size=4", "train.device=cpu"])
    warnings = size_warnings(cfg.model, cfg.train.device, DataProfile(100, 2, 64, 64))
    assert any("3136 tokens per image (224 px in 4-px patches) on a CPU" in w and "model.patch_size=28" in w
               for w in warnings)
    assert any("model.img_size=224 is over twice the images' median short side (64 px)" in w for w in warnings)
    assert size_warnings(build_config(overrides=["model.img_size=32", "model.patch_size=4"]).model, "auto",
                         DataProfile(100, 2, 32, 32)) == []
    # a Swin's window attention and an MViT's pooled keys grow about linearly with the tokens: no
    # patch-size advice, only the upsampling
    for name in ("swin_tiny_patch4_window7_224", "mvitv2_tiny"):
        cfg = build_config(overrides=[f"model.name={name}", "train.device=cpu"], model_config=config_class)
        assert [w.split(":")[0] for w in size_warnings(cfg.model, "cpu", DataProfile(100, 2, 64, 64))] == [
            "model.img_size=224 is over twice the images' median short side (64 px)"], name


def test_hymenoptera_photos_train_planned_on_the_batched_path(tmp_path: Path, caplog):
    path = need(HYMENOPTERA_TAR)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={path}", f"train.run_dir={tmp_path / 'run'}", "train.batch_size=64",
                              *SHORT], CONFIG_CHECKS)
        summary = train(cfg)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan: 245 training images of 2 classes" in log and "plan: model.img_size=64" in log
    assert f"plan: optim.lr={2e-3 * (64 / 256) ** 0.5:.2g}" in log  # follows the user's batch size
    assert "plan: train.batch_size" not in log and "plan: train.total_steps" not in log  # the user's keys
    assert "train: caching at 73x73 (photos of" in log and "val: caching at 73x73" in log
    assert "input pipeline: batched in-RAM gather + device random-resized-crop/flip" in log
    assert cfg.model.img_size == 64 and cfg.train.batch_size == 64 and cfg.train.total_steps == 3
    assert summary["step"] == 3
    assert 0 <= summary["val_top1"] <= 1 and "test_top1" not in summary  # hymenoptera has train/ and val/ only


@pytest.fixture(scope="module")
def imagenet_csv(tmp_path_factory) -> Path:
    """The ImageNet sample's first 320 photos (sorted by WordNet id) re-labelled into four classes
    by position (quarters of the sorted ids: mostly fish/birds, reptiles/..., dogs, ...), every
    fifth one held out as ``val``: a label file of real photos of many sizes."""
    root = tmp_path_factory.mktemp("imagenet")
    with tarfile.open(need(IMAGENET_TAR)) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name)[:320]
        tf.extractall(root, members=members, filter="data")
    rows = [{"path": m.name, "label": f"group{i * 4 // len(members)}", "split": "val" if i % 5 == 4 else "train"}
            for i, m in enumerate(members)]
    return write_csv(root / "labels.csv", rows)


def test_imagenet_sample_relabelled_trains_planned_from_a_label_file(imagenet_csv: Path, tmp_path: Path, caplog):
    with caplog.at_level(logging.INFO, logger="vitflow"):
        summary = train(planned_config([f"data.path={imagenet_csv}", f"train.run_dir={tmp_path / 'run'}", *SHORT],
                                       CONFIG_CHECKS))
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan: 256 training images of 4 classes" in log and "plan: train.batch_size=64" in log
    assert "input pipeline: batched in-RAM gather + device random-resized-crop/flip" in log
    assert summary["step"] == 3 and 0 <= summary["val_top1"] <= 1


def test_cache_resolution_full_keeps_photos_on_the_per_image_path(tmp_path: Path, caplog):
    path = need(HYMENOPTERA_TAR)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        train(planned_config([f"data.path={path}", f"train.run_dir={tmp_path / 'run'}", "data.cache_resolution=full",
                              "train.total_steps=1", "data.num_workers=0"], CONFIG_CHECKS))
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "caching at" not in log and "input pipeline: per-image decode/augment" in log
