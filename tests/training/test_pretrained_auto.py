"""``model.pretrained=auto`` (a planned run's default): a backbone from the Hugging Face cache, else
downloaded from the hub through ``HF_ENDPOINT`` (a stand-in hub on 127.0.0.1 serving a small
timm-format model under the first backbone's name), else from scratch after one line; a hub that
does not answer costs a few seconds at most."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from helpers import ENV, HYMENOPTERA_TAR, need
from hub_server import COMMIT, HubServer
from servers import free_port
from vitflow.cli.commands import CONFIG_CHECKS
from vitflow.config.messages import MESSAGES
from vitflow.models import create_model
from vitflow.models.pretrained import backbones
from vitflow.models.pretrained.backbones import BACKBONES
from vitflow.training.plan.clock import Clock
from vitflow.training.plan.recipe import planned_config

CLOCK = Clock(step_s=0.5, eval_image_s=0.002, decode_s=0.004, precision="fp32", threads=2, by_threads={2: 0.5},
              probe_s=3.0)
SMALL = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2}


@pytest.fixture
def backbone_folder(tmp_path):
    """A timm-format snapshot of a small ViT named as the first backbone's architecture."""
    folder = tmp_path / "served"
    folder.mkdir()
    torch.manual_seed(0)
    model = create_model(BACKBONES[0].name, num_classes=10, **SMALL)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architecture": BACKBONES[0].name, "num_classes": 10, "model_args": SMALL,
        "pretrained_cfg": {"input_size": [3, 32, 32], "mean": [0.5] * 3, "std": [0.5] * 3, "crop_pct": 0.9}}))
    return folder


@pytest.fixture
def online(tmp_path, monkeypatch):
    """The hub switched on for this test, an empty cache under tmp, the probe asked anew."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(backbones, "_REACHABLE", {})
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    return tmp_path / "hf-cache"


def _plan(*overrides: str):
    return planned_config([f"data.path={need(HYMENOPTERA_TAR)}", *overrides], CONFIG_CHECKS)


def test_auto_downloads_the_first_backbone_then_needs_no_network(online, backbone_folder, monkeypatch, caplog):
    hub = HubServer({BACKBONES[0].hub: backbone_folder})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    try:
        with caplog.at_level(logging.INFO, logger="vitflow"):
            cfg = _plan()
        assert cfg.model.pretrained == f"hf-hub:{BACKBONES[0].hub}@{COMMIT}"  # the exact snapshot, from now on
        assert cfg.model.name == "auto"  # the source's architecture: the fine-tune's plan
        assert "fine-tune: the architecture of" in caplog.text and BACKBONES[0].name in caplog.text
        assert f"plan: model.pretrained=hf-hub:{BACKBONES[0].hub}@{COMMIT}" in caplog.text
        assert f"downloaded from {hub.url}" in caplog.text and "fine-tune" in caplog.text
        snapshot = next(online.glob("models--*/snapshots/*"))
        assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors"]
        assert (snapshot / "model.safetensors").read_bytes() == (backbone_folder / "model.safetensors").read_bytes()
        served = hub.requests
    finally:
        hub.stop()
    caplog.clear()
    monkeypatch.setattr(backbones, "_REACHABLE", {})
    with caplog.at_level(logging.INFO, logger="vitflow"):
        again = _plan()  # the hub is gone: the cache alone
    assert again.model.pretrained == cfg.model.pretrained and hub.requests == served
    assert "from the Hugging Face cache" in caplog.text


def test_a_hub_that_cannot_be_reached_costs_seconds_and_one_line(online, monkeypatch, caplog):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = _plan()
    assert time.perf_counter() - t0 < 60  # the plan itself (its clock is stubbed); the hub's share below
    assert cfg.model.pretrained is None and cfg.model.name == "vit_compact_patch8_64"  # from scratch
    lines = [r.getMessage() for r in caplog.records if "model.pretrained=auto" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("model.pretrained=auto: no backbone in the Hugging Face cache")
    assert "could not be reached" in lines[0] and f"hf download {BACKBONES[0].hub}" in lines[0]
    assert MESSAGES["no_backbone"].template.split("{why}")[1].split("{hub}")[0] in lines[0]
    t0 = time.perf_counter()
    assert backbones.choose_backbone("cpu")[1] is None and time.perf_counter() - t0 < 1  # asked once a process
    # offline by the environment: no request at all; model.pretrained=none: no line either
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE=1" in backbones.choose_backbone("cpu")[2]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vitflow"):
        assert _plan("model.pretrained=none").model.pretrained is None
    assert "model.pretrained=auto" not in caplog.text


def test_auto_outside_a_planned_run_is_one_line():
    from vitflow.models.pretrained.hub import resolve_pretrained

    with pytest.raises(ValueError, match="model.pretrained=auto chooses a backbone for a planned run"):
        resolve_pretrained("auto")


@pytest.mark.slow
def test_vitflow_train_on_photos_fine_tunes_the_downloaded_backbone(backbone_folder, tmp_path):
    hub = HubServer({BACKBONES[0].hub: backbone_folder})
    env = {**ENV, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path / "cache")}
    run = tmp_path / "run"
    try:
        out = subprocess.run([sys.executable, "-m", "vitflow", "train", "--json", f"data.path={need(HYMENOPTERA_TAR)}",
                              "train.total_steps=4", f"train.run_dir={run}"], env=env, capture_output=True, text=True,
                             timeout=600)
    finally:
        hub.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"downloaded from {hub.url}" in out.stderr and "fine-tune" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["step"] == 4 and 0 <= summary["val_top1"] <= 1
    assert f"pretrained: hf-hub:{BACKBONES[0].hub}@{COMMIT}" in (run / "config.yaml").read_text()
    assert os.path.isdir(tmp_path / "cache")
