"""vitflow.load(...): a run, its ONNX export and its INT8 files predict on PIL images what
`vitflow predict` says of the same files (top-k classes, probabilities within 1e-6); features,
attention maps as a matplotlib figure, and one-line errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import vitflow
from helpers import HYMENOPTERA_TAR, need
from vitflow.cli import main
from vitflow.data import open_split

SMALL = dict(model__img_size=32, model__patch_size=8, model__embed_dim=48, model__depth=2, model__num_heads=3,
             train__batch_size=8, train__total_steps=3, train__eval_every=0, train__precision="fp32",
             train__live_report=False, train__tensorboard=False, optim={"warmup_steps": 1})


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """16 real photos of each split from the hymenoptera tar (both classes) as ``photos/{train,val}/<class>/*.jpg``,
    plus two files to predict on that exercise the decoder: an EXIF-rotated JPEG and a palette PNG."""
    root = tmp_path_factory.mktemp("photos")
    for split in ("train", "val"):
        src = open_split(need(HYMENOPTERA_TAR), f"{split}[:16]")
        for i in range(len(src)):
            path = root / "photos" / split / src.classes[int(src.labels[i])] / f"{i:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(src.encoded(i))
    extra = root / "extra"
    extra.mkdir()
    photo = Image.open(next((root / "photos" / "val").rglob("*.jpg")))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    photo.save(extra / "rotated.jpg", exif=exif, quality=90)
    photo.convert("P", palette=Image.Palette.ADAPTIVE).save(extra / "palette.png")
    return root


@pytest.fixture(scope="module")
def run(photos, tmp_path_factory):
    return vitflow.train(data=photos / "photos", model="vit_tiny_patch16_224", preset="cifar10-vit-tiny",
                         data__test_split="none", train__run_dir=str(tmp_path_factory.mktemp("run") / "r"), **SMALL)


def files_of(photos) -> list[str]:
    return sorted(str(p) for p in (photos / "photos" / "val").rglob("*.jpg"))[:10] + sorted(
        str(p) for p in (photos / "extra").iterdir())


def cli_predict(model: str, files: list[str], capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["predict", model, *files, "--json", "--topk", "2"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def assert_same(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert [t["class"] for t in a["top"]] == [t["class"] for t in b["top"]]
        assert np.allclose([t["prob"] for t in a["top"]], [t["prob"] for t in b["top"]], atol=1e-6, rtol=0)


def test_run_onnx_and_int8_predict_on_pil_images_what_vitflow_predict_says(run, photos, tmp_path, capsys):
    files = files_of(photos)
    onnx, int8, int8_pt = tmp_path / "m.onnx", tmp_path / "m8.onnx", tmp_path / "m8.pt"
    assert main(["export", str(run.folder), "-o", str(onnx)]) == 0
    assert main(["quantize", str(onnx), "-o", str(int8)]) == 0
    assert main(["quantize", str(run.checkpoint), "--backend", "torch", "-o", str(int8_pt)]) == 0
    for model in (run.folder, onnx, int8, int8_pt):
        theirs = cli_predict(str(model), files, capsys)
        ours = vitflow.load(model).predict([Image.open(f) for f in files], topk=2)
        assert_same(ours, theirs)
        assert all(0 < t["prob"] <= 1 for r in ours for t in r["top"])
    by_path = vitflow.load(run).predict(files, topk=2)  # paths: the CLI's very records, named by path
    assert [r["image"] for r in by_path] == [r["path"] for r in cli_predict(str(run.folder), files, capsys)]


def test_arrays_tensors_folders_and_probabilities_agree(run, photos):
    clf = vitflow.load(run)
    image = Image.open(files_of(photos)[0])
    array = np.array(image)  # (H, W, 3) uint8
    tensor = torch.from_numpy(array).permute(2, 0, 1)  # (3, H, W) uint8
    one = clf.predict(image, topk=2)
    assert isinstance(one, dict) and one["image"] == "images[0]"
    assert clf.predict([array, tensor], topk=2)[0]["top"] == clf.predict([array, tensor], topk=2)[1]["top"] == one["top"]
    probs = clf.probabilities([image, array])
    assert probs.shape == (2, len(clf.labels)) and torch.allclose(probs.sum(1), torch.ones(2))
    assert abs(float(probs[0].max()) - one["top"][0]["prob"]) < 1e-6
    folder = clf.predict(photos / "photos" / "val", topk=1)
    assert len(folder) == 16 and all(os.path.isfile(r["image"]) for r in folder)
    assert clf.labels == ["ants", "bees"] and clf.preprocess.image_size == 32
    with pytest.raises(TypeError, match=r"images\[0\] is a float32 tensor: vitflow takes uint8 images"):
        clf.predict(tensor.float() / 255)


def test_features_and_attention_maps(run, photos, capsys):
    clf = vitflow.load(run)
    files = files_of(photos)[:3]
    feats = clf.embed([Image.open(f) for f in files])
    assert feats.shape == (3, 48) and feats.dtype == np.float32
    capsys.readouterr()
    out = photos / "f.npy"
    assert main(["embed", str(run.folder), *files, "-o", str(out)]) == 0
    assert np.allclose(np.load(out), feats, atol=1e-6)  # vitflow embed's features
    fig = clf.attention_maps(Image.open(files[0]))
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure) and len(fig.axes) == 1 + 3 + 1  # the image, 3 heads, the rollout
    onnx = vitflow.load(run.export(photos / "a.onnx"))  # Run.export: vitflow export, verified
    with pytest.raises(ValueError, match="attention maps need the PyTorch model"):
        onnx.attention_maps(Image.open(files[0]))


def test_errors_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in run directory"):
        vitflow.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a vitflow run directory"):
        vitflow.Run(tmp_path)
