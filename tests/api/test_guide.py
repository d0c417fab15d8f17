"""The Python API guide (docs/guides/python-api.md) runs as written: its ```python blocks, in order,
in one module's namespace, in a folder holding `photos/` (real hymenoptera photos in train/ and val/
class folders), as a reader would paste them into a notebook. To keep the file short every model the
guide trains is shrunk to 2 blocks of width 48 (keys added before the guide's own, which win): the
calls, the data and the steps are the guide's. The API reference lists the new names."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import HYMENOPTERA_TAR, ROOT, need
from vitflow.data import open_split

GUIDE = ROOT / "docs" / "guides" / "python-api.md"
SHRINK = {"model.depth": 2, "model.embed_dim": 48, "model.num_heads": 3}


def blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.fixture
def small_models(monkeypatch):
    """Every run the guide starts gets :data:`SHRINK` under its own keys (a resume keeps its saved config)."""
    from vitflow.api import config

    keys = config.override_items
    monkeypatch.setattr(config, "override_items",
                        lambda overrides: (lambda items: items if "train.resume" in items else {**SHRINK, **items})(
                            keys(overrides)))


@pytest.fixture
def photos_here(tmp_path, monkeypatch):
    for split, n in (("train", 32), ("val", 16)):
        src = open_split(need(HYMENOPTERA_TAR), f"{split}[:{n}]")
        for i in range(len(src)):
            path = tmp_path / "photos" / split / src.classes[int(src.labels[i])] / f"{i:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(src.encoded(i))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_the_guide_runs_as_written(photos_here, small_models, capsys):
    code = blocks(GUIDE)
    assert len(code) >= 8
    module = types.ModuleType("python_api_guide")  # importable: its classes pickle to loader workers
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(code):
            try:
                exec(compile(block, f"{GUIDE.name}, python block {i + 1}", "exec"), module.__dict__)
            except Exception as e:  # noqa: BLE001 - say which block failed
                raise AssertionError(f"python block {i + 1} of {GUIDE.name} failed: {type(e).__name__}: {e}\n"
                                     f"{block}") from e
    finally:
        sys.modules.pop(module.__name__, None)
    ns = module.__dict__
    out = capsys.readouterr().out
    assert "unknown key 'train.total_stepz'; did you mean 'train.total_steps'? (in the arguments)" in out
    assert "tta='flp': cannot read 'flp': expected flip, crops5, " in out and "; did you mean 'flip'?" in out
    assert ns["in_tar"].targets == [n.split("/")[-2] for n in ns["in_tar"].names] and len(ns["in_tar"]) == 32
    first = Image.open(sorted((photos_here / "photos" / "train").rglob("*.jpg"))[0])
    assert np.array_equal(np.asarray(ns["in_tar"][0][0]), np.asarray(first))  # the tar's bytes, read per process
    assert ns["cfg"].data.path.startswith("python:") and ns["cfg"].data.source == "python"
    assert (photos_here / "photos.onnx").is_file() and (photos_here / "photos-int8.onnx").is_file()
    assert ns["more"].step == 20 and ns["result"]["images"] == 16
    assert ns["probs"].shape == (1, 2) and ns["features"].shape[0] == 1
    assert ns["run"].summary["stopped"].startswith("val top-1") and ns["run"].step == 5  # the callback stopped it
    assert (photos_here / "attention.png").stat().st_size > 1000


def test_the_api_reference_lists_the_new_names():
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    for name in ("vitflow.api.run.train", "vitflow.api.classifier.load", "vitflow.api.config.Config",
                 "vitflow.api.run.Run", "vitflow.api.classifier.Classifier", "vitflow.training.callbacks.Callback",
                 "vitflow.data.sources.pyobjects"):
        assert f"::: {name}" in page
