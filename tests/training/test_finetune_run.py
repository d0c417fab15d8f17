"""Your own run as a backbone: ``model.pretrained=RUN`` (a run folder, one of its checkpoints, or the
hub folder it was exported to) names its architecture exactly (one resolver,
``vitflow.models.pretrained.hub.resolve_pretrained``), and the plan plans a fine-tune of it (the
source's architecture and input size, a fine-tune's lr and layer decay), saying so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from helpers import make_folder, take_pretrained
from vitflow.checkpoint import load_checkpoint
from vitflow.cli.commands import CONFIG_CHECKS
from vitflow.config import ConfigError, build_config
from vitflow.infer.export.hub_folder import save_hub_folder
from vitflow.models.pretrained.hub import resolve_pretrained
from vitflow.training import Trainer, train
from vitflow.training.plan.clock import Clock
from vitflow.training.plan.recipe import planned_config

CLOCK = Clock(step_s=0.05, eval_image_s=0.001, decode_s=0.001, precision="fp32", threads=1, by_threads={1: 0.05},
              probe_s=0.1)
ARCH = {"img_size": 16, "patch_size": 4, "depth": 2, "pos_embed": "sincos2d", "global_pool": "avg"}


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A 4-step photo-recipe run (the compact ViT with sin-cos positions and average pooling, at
    16 px in 4-px patches, 2 blocks) on 3 classes: a finished run to start from."""
    root = tmp_path_factory.mktemp("src")
    data = make_folder(root / "data", per_class=8, size=16, split="train")
    make_folder(data, per_class=4, size=16, split="val", seed=1)
    run = root / "run"
    train(build_config("photos-auto", overrides=[
        f"data.path={data}", f"train.run_dir={run}", "model.img_size=16", "model.patch_size=4", "model.depth=2",
        "model.pos_embed=sincos2d", "model.global_pool=avg", "train.total_steps=4", "train.batch_size=8",
        "data.mean=[0.4, 0.4, 0.4]", "data.std=[0.3, 0.3, 0.3]"]))
    return run


def test_a_run_its_checkpoint_and_its_hub_folder_name_their_architecture(source_run: Path, tmp_path: Path):
    ckpt = sorted((source_run / "checkpoints").glob("step-*.pt"))[-1]
    hub = tmp_path / "hub"
    save_hub_folder(ckpt, hub)
    for spec, origin in ((source_run, "vitflow run"), (ckpt, "vitflow checkpoint"), (hub, "vitflow hub folder")):
        pre = resolve_pretrained(spec)
        assert pre.model_name == "vit_compact_patch8_64" and pre.origin.startswith(origin) and pre.vitflow
        assert {k: pre.model_kwargs[k] for k in ARCH} == ARCH and pre.model_kwargs["num_classes"] == 3
        assert pre.preprocess["input_size"] == 16 and pre.preprocess["mean"] == [0.4, 0.4, 0.4]
        assert pre.label_names == ["a", "b", "c"]
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="a run folder without a checkpoint yet"):
        resolve_pretrained(empty)


def test_auto_takes_the_whole_architecture_from_a_run(source_run: Path):
    cfg = build_config("finetune", overrides=[f"model.pretrained={source_run}", "data.path=x"])
    take_pretrained(cfg)
    m = cfg.model
    assert (m.name, m.img_size, m.patch_size, m.depth, m.pos_embed, m.global_pool) == (
        "vit_compact_patch8_64", 16, 4, 2, "sincos2d", "avg")
    assert tuple(cfg.data.mean) == (0.4, 0.4, 0.4)
    bare = source_run.parent / "bare.pt"
    torch.save({"blocks.0.norm1.weight": torch.ones(192)}, bare)
    with pytest.raises(ConfigError, match="has no config naming an architecture .* or a vitflow run"):
        take_pretrained(build_config("finetune", overrides=[f"model.pretrained={bare}", "data.path=x"]))


def test_planned_finetune_of_a_run_loads_it_and_says_so(source_run: Path, tmp_path: Path, caplog, monkeypatch):
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    data = make_folder(tmp_path / "two", classes=("x", "y"), per_class=8, size=24, split="train", seed=2)
    make_folder(data, classes=("x", "y"), per_class=4, size=24, split="val", seed=3)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={data}", f"model.pretrained={source_run}", f"train.run_dir={tmp_path / 'r'}"],
                             CONFIG_CHECKS)
        trainer = Trainer(cfg)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan: model.name=auto  (fine-tune: the architecture of vitflow run" in log
    assert "vit_compact_patch8_64 (img_size=16, patch_size=4, pos_embed=sincos2d, global_pool=avg)" in log
    assert "plan: optim.layer_decay=0.75" in log and "plan: model.patch_drop_rate=0.0" in log
    assert "plan: model.img_size" not in log  # the source's input size, not the plan's
    assert cfg.optim.lr == pytest.approx(2e-4 * (4 / 32) ** 0.5, rel=0.03) and cfg.train.batch_size == 4
    assert (cfg.model.img_size, cfg.model.depth, cfg.model.pos_embed) == (16, 2, "sincos2d")
    state = load_checkpoint(source_run)
    own = trainer.model.state_dict()
    kept = [k for k in state["model"] if not k.startswith("head.")]
    assert len(kept) > 20 and all(torch.equal(own[k], state["model"][k]) for k in kept)  # the run's weights, loaded
    assert trainer.model.head.weight.shape[0] == 2  # a new head for the 2 classes
    assert trainer.fit()["step"] == cfg.train.total_steps
    bare = tmp_path / "bare.pt"  # weights that name no architecture: the plan leaves model.name=auto to say so
    torch.save({k: v for k, v in state["model"].items()}, bare)
    with pytest.raises(ConfigError, match="has no config naming an architecture"):
        planned_config([f"data.path={data}", f"model.pretrained={bare}"], CONFIG_CHECKS)
