"""A run from a pretrained snapshot folder: ``model.name=auto`` takes the architecture from its
config.json, the weights' preprocessing becomes the run's (saved in the checkpoint, logged),
and keys the user set win."""

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from helpers import digits_config, take_pretrained
from vitflow.checkpoint import load_checkpoint
from vitflow.config import ConfigError, build_config
from vitflow.models import check_config, create_model
from vitflow.training import Trainer

MEAN, STD = [0.3, 0.35, 0.4], [0.2, 0.21, 0.22]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A timm-style snapshot folder of the digits ViT, with non-default mean/std/crop/interpolation."""
    folder = tmp_path_factory.mktemp("snap")
    torch.manual_seed(3)
    model = create_model("vit_digits_patch2_8", num_classes=10)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architecture": "vit_digits_patch2_8", "num_classes": 10, "global_pool": "avg",
        "pretrained_cfg": {"input_size": [3, 8, 8], "mean": MEAN, "std": STD, "crop_pct": 0.95,
                           "interpolation": "bilinear"}}))
    return folder, model


def test_auto_run_trains_with_the_weights_preprocessing(tmp_path, snapshot, caplog):
    folder, source = snapshot
    run = tmp_path / "run"
    cfg = digits_config(run, "model.name=auto", f"model.pretrained={folder}", "train.total_steps=3",
                        "train.batch_size=32", "train.eval_every=3", "optim.warmup_steps=1")
    with caplog.at_level(logging.INFO):
        trainer = Trainer(cfg)
    assert cfg.model.name == "vit_digits_patch2_8"
    # loaded (the head too: 10 classes both sides) before any step
    assert torch.equal(trainer.model.blocks[0].attn.qkv.weight.cpu(), source.blocks[0].attn.qkv.weight)
    assert torch.equal(trainer.model.head.weight.cpu(), source.head.weight)
    result = trainer.fit()
    assert "preprocessing from the weights: mean (0.3, 0.35, 0.4), std (0.2, 0.21, 0.22), 8 px, crop 0.95, " \
           "bilinear" in caplog.text
    pp = load_checkpoint(result["checkpoint"])["preprocess"]
    assert pp == {"image_size": 8, "crop_pct": 0.95, "interpolation": "bilinear", "mean": MEAN, "std": STD}
    assert "name: vit_digits_patch2_8" in (run / "config.yaml").read_text()


def test_user_keys_win_presets_do_not(snapshot):
    """Command-line keys stay; the preset's data.mean/std (0.5) give way to the weights'."""
    folder, _ = snapshot
    cfg = build_config(overrides=[f"model.pretrained={folder}", "data.std=[0.1,0.1,0.1]", "data.crop_pct=1.0"])
    take_pretrained(cfg)
    assert (list(cfg.data.mean), list(cfg.data.std), cfg.data.crop_pct, cfg.data.interpolation,
            cfg.model.img_size) == (MEAN, [0.1] * 3, 1.0, "bilinear", 8)


def test_auto_needs_a_config(tmp_path, snapshot):
    with pytest.raises(ConfigError, match="model.name=auto takes the architecture from model.pretrained"):
        build_config(overrides=["model.name=auto"], checks={"model": check_config})
    cfg = build_config(overrides=["model.name=auto", f"model.pretrained={snapshot[0] / 'model.safetensors'}"],
                       checks={"model": check_config})
    with pytest.raises(ConfigError, match="has no config naming an architecture"):
        take_pretrained(cfg)


def test_create_pretrained_model(snapshot):
    """The architecture, sizes and weights from the snapshot; a head of another class count reset."""
    from vitflow.models.pretrained.config import create_pretrained_model

    folder, source = snapshot
    model, pre = create_pretrained_model(str(folder))
    assert pre.preprocess["mean"] == MEAN and model.num_classes == 10
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(model.eval()(x), source.eval()(x), atol=1e-6)
    five, _ = create_pretrained_model(str(folder), num_classes=5)
    assert five.head.weight.shape == (5, 64)
    assert torch.equal(five.blocks[3].mlp.fc1.weight, source.blocks[3].mlp.fc1.weight)


def test_auto_leaves_a_presets_architecture_keys_to_the_weights(snapshot):
    """cifar10-vit-tiny sets global_pool=avg and pos_embed=sincos2d for its own model: under
    model.name=auto they are reset; its data.mean gives way to the weights'."""
    cfg = build_config("cifar10-vit-tiny", overrides=["model.name=auto", f"model.pretrained={snapshot[0]}"])
    take_pretrained(cfg)
    m = cfg.model
    assert (m.name, m.global_pool, m.pos_embed, m.img_size, list(cfg.data.mean)) == (
        "vit_digits_patch2_8", None, "learned", 8, MEAN)


def test_print_config_shows_what_the_weights_set(snapshot, capsys):
    from vitflow.cli import main

    assert main(["train", "--print-config", "model.name=auto", f"model.pretrained={snapshot[0]}"]) == 0
    out = capsys.readouterr().out
    assert "name: vit_digits_patch2_8" in out and "- 0.35" in out and "interpolation: bilinear" in out
