"""vitflow embed (pooled features of files, folders and tars, with their paths) and vitflow eval
--knn (DINO's weighted k-NN on frozen features) on a tiny trained run."""

import json
import logging
import math

import numpy as np
import pytest
import torch

from helpers import make_folder, tar_folder
from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.data import decode_image, model_input, open_split
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.infer import collect_images
from vitflow.infer.features.backbone import Backbone, default_preprocess
from vitflow.infer.features.embed import embed_images


def direct_features(model, pp: Preprocess, images: list[torch.Tensor]) -> np.ndarray:
    """The pooled features computed here, without vitflow.infer: eval transform, normalise,
    forward_features, forward_head(pre_logits=True)."""
    x = model_input(torch.stack([eval_transform(pp)(im) for im in images]), pp.mean, pp.std, torch.device("cpu"))
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True).numpy()


def test_embed_files_folders_and_tars(tiny_run, tmp_path, capsys, caplog):
    run, _ = tiny_run
    folder = make_folder(tmp_path / "imgs", classes=("a", "b"), per_class=3)
    (folder / "a" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not an image")
    tar = tar_folder(make_folder(tmp_path / "more", classes=("c",), per_class=2, seed=1), tmp_path / "more.tar")
    out = tmp_path / "out" / "features.npy"
    with caplog.at_level(logging.WARNING, logger="vitflow"):
        assert main(["embed", str(run), str(folder), str(tar), "-o", str(out), "--batch-size", "4", "--json"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.strip().splitlines()  # --json: the JSON line alone on stdout
    r = json.loads(line)
    paths = (tmp_path / "out" / "features.paths.txt").read_text(encoding="utf-8").splitlines()
    feats = np.load(out)
    assert r == {"count": 8, "dim": 64, "skipped": 1, "features": str(out), "paths": str(out.with_name("features.paths.txt"))}
    assert feats.shape == (8, 64) and feats.dtype == np.float32 and len(paths) == 8
    assert not any("broken" in p for p in paths) and sum(p.startswith(str(tar)) for p in paths) == 2
    assert [rec for rec in caplog.records if "broken.jpg" in rec.getMessage()]  # one warning names it

    state = load_checkpoint(run)
    model, pp = model_from_checkpoint(state), Preprocess.from_dict(state["preprocess"])
    refs = {ref.name: ref for ref in collect_images([str(folder), str(tar)])}
    want = direct_features(model, pp, [decode_image(refs[p].read(), p) for p in paths])
    np.testing.assert_allclose(feats, want, atol=1e-5)
    assert np.abs(feats).max() > 0.1 and len({tuple(np.round(f, 4)) for f in feats}) == 8


def test_embed_plain_weights_with_model_name(tiny_run, tmp_path, capsys):
    from safetensors.torch import save_file

    run, _ = tiny_run
    model = model_from_checkpoint(load_checkpoint(run))
    weights = tmp_path / "backbone.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("head.")}, str(weights))
    folder = make_folder(tmp_path / "imgs", classes=("a",), per_class=3)
    out = tmp_path / "f.npy"
    assert main(["embed", str(weights), str(folder), "--model", "vit_digits_patch2_8", "-o", str(out)]) == 0
    backbone = Backbone(model, default_preprocess(model), None, str(run), "vit_digits_patch2_8")
    want, _ = embed_images(backbone, collect_images([folder]))
    np.testing.assert_allclose(np.load(out), want, atol=1e-5)
    capsys.readouterr()
    assert main(["embed", str(weights), str(folder), "-o", str(out)]) == 2  # no --model: one line saying so
    assert "--model NAME" in capsys.readouterr().err


def reference_knn_top1(bank, bank_labels, queries, query_labels, k, t=0.07):
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    right = 0
    for q, y in zip(queries, query_labels):
        sim = bank @ q
        votes = np.zeros(bank_labels.max() + 1)
        for j in np.argsort(-sim)[:k]:
            votes[bank_labels[j]] += math.exp(sim[j] / t)
        right += votes.argmax() == y
    return right / len(queries)


def test_eval_knn_on_a_run(tiny_run, capsys):
    run, _ = tiny_run
    assert main(["eval", str(run), "--knn", "10", "--json"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.strip().splitlines()
    r = json.loads(line)
    assert r["knn_k"] == 10 and r["split"] == "test" and r["train_images"] == 1438 and r["images"] == 359
    assert f"test k-NN top-1 {r['knn_top1']:.2%}" in captured.err

    state = load_checkpoint(run)
    model, pp = model_from_checkpoint(state), Preprocess.from_dict(state["preprocess"])
    feats = {}
    for split in ("train[:80%]", "train[80%:]"):  # the run's splits, read and embedded here
        src = open_split(None, split, "digits")
        feats[split] = (direct_features(model, pp, [src.load(i) for i in range(len(src))]), np.asarray(src.labels))
    want = reference_knn_top1(*feats["train[:80%]"], *feats["train[80%:]"], k=10)
    assert r["knn_top1"] == pytest.approx(want, abs=1e-9)  # the same images right (1 image: 0.0028)
    assert r["knn_top1"] > 0.25  # 10 digit classes: chance is 0.1


def test_eval_knn_bad_input(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    assert main(["eval", str(run), "--data", str(tmp_path)]) == 2  # --data without --knn
    assert "--knn" in capsys.readouterr().err
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    assert main(["eval", str(weights), "--knn", "5", "--model", "vit_digits_patch2_8"]) == 2
    assert "weights" in capsys.readouterr().err


def test_eval_knn_of_a_run_on_other_classes(tiny_run, tmp_path, capsys):
    """A backbone trained on the digits judged on data of other classes (the transfer use of k-NN):
    the memory bank and queries take that data's classes, not the checkpoint's head."""
    run, _ = tiny_run
    data = make_folder(tmp_path / "other", classes=("ant", "bee"), per_class=6, split="train")
    make_folder(data, classes=("ant", "bee"), per_class=4, split="test", seed=1)
    assert main(["eval", str(run), "--knn", "3", "--data", str(data), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["train_images"], r["images"]) == (12, 8)
    assert r["knn_top1"] == 1.0  # two classes of distinct mean colour: every neighbour vote is right


def test_plain_backbone_takes_the_input_size_of_its_preprocessing(tmp_path):
    """A transformers snapshot whose config says 56 px but whose preprocessor crops 28 px: embed and
    k-NN run at 28 px with that preprocessing, as fine-tuning does (model.img_size from the weights)."""
    transformers = pytest.importorskip("transformers")
    from vitflow.infer.features.backbone import load_backbone

    cfg = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                                    patch_size=14)
    transformers.Dinov2Model(cfg).save_pretrained(tmp_path / "snap")
    (tmp_path / "snap" / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 32},
        "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "resample": 3}))
    bb = load_backbone(tmp_path / "snap")
    assert (bb.preprocess.image_size, bb.model.img_size, bb.preprocess.mean) == (28, 28, (0.5, 0.5, 0.5))
