"""Test-time augmentation: the spec syntax, flip / five-crop / multi-scale averages against hand
computations, `vitflow eval/predict --tta` on a tiny digits checkpoint, and the ONNX export with the
flip average in its graph against the PyTorch TTA."""

import json

import pytest
import torch
import torchvision.transforms.v2.functional as TF

from vitflow.cli import main
from vitflow.infer import Predictor
from vitflow.infer.export.formats import export_checkpoint
from vitflow.infer.runtimes.onnx import OnnxModel
from vitflow.infer.tta import TTAModel, TTASpec, parse_tta, tta_probs, views
from vitflow.models import create_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("vit_digits_patch2_8", num_classes=10).eval()


def test_spec_syntax_and_errors():
    assert parse_tta("flip") == TTASpec(flip=True)
    assert parse_tta("flip,crops5").views == 10
    s = parse_tta("flip,scales=0.875,1.0,1.143")
    assert s.scales == (0.875, 1.0, 1.143) and s.views == 6 and str(s) == "flip,scales=0.875,1,1.143"
    assert parse_tta("scales:0.5,1") == TTASpec(scales=(0.5, 1.0))
    assert not parse_tta("none").enabled and not parse_tta(None).enabled
    for bad, says in (("flop", "'flop'"), ("flip,flip", "'flip'"), ("scales=", "at least one"),
                      ("scales=0,1", "not > 0"), ("0.5", "'0.5'")):
        with pytest.raises(ValueError, match=says):
            parse_tta(bad)


def test_flip_of_a_mirror_symmetric_input_equals_no_tta(model):
    torch.manual_seed(1)
    half = torch.randn(3, 3, 8, 4)
    x = torch.cat([half, half.flip(-1)], dim=-1)  # each row reads the same backwards
    with torch.no_grad():
        plain = model(x).softmax(-1)
        tta = tta_probs(model, x, "flip")
    assert torch.allclose(tta, plain, atol=1e-6)
    assert not torch.allclose(plain[0], plain[1], atol=1e-3)  # the images differ, the test compares something


def test_flip_equals_the_hand_computed_average(model):
    torch.manual_seed(2)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        ref = (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2
        out = TTAModel(model, "flip")(x)
        assert torch.allclose(tta_probs(model, x, "flip"), ref, atol=1e-6)
        assert torch.allclose(out.softmax(-1), ref, atol=1e-6) and torch.allclose(out.exp().sum(-1), torch.ones(4))
        assert not torch.allclose(ref, model(x).softmax(-1), atol=1e-4)  # the mirror changes the figures
        ml = (model(x).sigmoid() + model(x.flip(-1)).sigmoid()) / 2  # multi-label: sigmoids averaged
        assert torch.allclose(tta_probs(model, x, "flip", "multilabel"), ml, atol=1e-6)


def test_crops5_views_and_average_match_torchvision_five_crop(model):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, 8)
    v = views(x, parse_tta("crops5"))
    assert v.shape == (10, 3, 8, 8)
    crops = TF.five_crop(x, [7, 7])  # 0.875 * 8 = 7: tl, tr, bl, br, centre
    want = torch.cat([torch.nn.functional.interpolate(c, size=(8, 8), mode="bilinear") for c in crops])
    assert torch.allclose(v, want)
    assert torch.equal(views(x, parse_tta("flip,crops5"))[10:], want.flip(-1))
    with torch.no_grad():
        ref = torch.stack([model(c).softmax(-1) for c in want.split(2)]).mean(0)
        assert torch.allclose(tta_probs(model, x, "crops5"), ref, atol=1e-6)
        ref2 = (ref * 5 + torch.stack([model(c.flip(-1)).softmax(-1) for c in want.split(2)]).sum(0)) / 10
        assert torch.allclose(tta_probs(model, x, "crops5,flip"), ref2, atol=1e-6)


def test_scales_run_the_model_at_other_resolutions(model):
    torch.manual_seed(4)
    x = torch.randn(2, 3, 8, 8)
    x12 = torch.nn.functional.interpolate(x, size=(12, 12), mode="bilinear")  # 1.5 * 8 = 12 (patch 2)
    with torch.no_grad():
        ref = (model(x).softmax(-1) + model(x12).softmax(-1)) / 2
        assert torch.allclose(tta_probs(model, x, "scales=1,1.5"), ref, atol=1e-6)


def test_eval_and_predict_with_tta_on_a_digits_checkpoint(tiny_run, tmp_path, capsys):
    run, summary = tiny_run
    assert main(["eval", str(run), "--tta", "flip", "--json"]) == 0
    cap = capsys.readouterr()
    r = json.loads(cap.out.strip().splitlines()[-1])
    assert r["tta"] == "flip" and r["images_per_s"] > 0 and "TTA flip" in cap.out + cap.err
    assert main(["eval", str(run), "--json"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["tta"] == "none" and plain["test_images"] == r["test_images"]
    assert plain["test_loss"] != r["test_loss"]

    p = Predictor.load(summary["checkpoint"], device="cpu")
    images = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    ref = (p.predict(images) + p.predict(images.flip(-1))) / 2
    p.set_tta("flip")
    assert torch.allclose(p.predict(images), ref, atol=1e-6)

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(2):  # mirror-symmetric photos: TTA flip must give the plain figures
        half = rng.integers(0, 256, (8, 4, 3), dtype=np.uint8)
        Image.fromarray(np.concatenate([half, half[:, ::-1]], axis=1)).save(tmp_path / f"sym{i}.png")
    images = [str(tmp_path / f"sym{i}.png") for i in range(2)]
    rows = {}
    for tta in ("none", "flip", "flip,crops5"):
        assert main(["predict", str(run), *images, "--tta", tta, "--json", "--topk", "3"]) == 0
        rows[tta] = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    for a, b in zip(rows["none"], rows["flip"]):
        assert [t["index"] for t in a["top"]] == [t["index"] for t in b["top"]]
        assert all(abs(x["prob"] - y["prob"]) <= 2e-6 for x, y in zip(a["top"], b["top"]))
    ten = rows["flip,crops5"]
    assert len(ten) == 2 and ten[0]["top"][0]["prob"] != rows["none"][0]["top"][0]["prob"]  # crops resample
    assert main(["eval", str(run), "--tta", "flap"]) != 0
    assert "--tta flap: cannot read 'flap'" in capsys.readouterr().err


def test_onnx_export_with_flip_matches_the_pytorch_tta(tiny_run, tmp_path):
    run, summary = tiny_run
    out = tmp_path / "flip.onnx"
    r = export_checkpoint(summary["checkpoint"], out, "onnx", tta="flip", log=lambda m: None)
    assert r["ok"] and r["images"] == 8 and max(r["max_abs_diff"].values()) <= 1e-4
    onnx_model = OnnxModel(out)
    assert onnx_model.info().tta == "flip"
    p = Predictor.load(summary["checkpoint"], device="cpu")
    torch.manual_seed(5)
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        want = tta_probs(p.model, x, "flip")
    got = torch.as_tensor(onnx_model(x)).float().softmax(-1)
    assert (got - want).abs().max() <= 1e-4
    assert not torch.allclose(want, p.model(x).softmax(-1), atol=1e-3)  # flip did change the output
    onnx_p = Predictor.load(out)
    assert onnx_p.tta == "flip"
    p.set_tta("flip")
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    assert (onnx_p.predict(images) - p.predict(images)).abs().max() <= 1e-4  # `vitflow predict` on either
    with pytest.raises(ValueError, match="already averages"):
        onnx_p.set_tta("flip")
    with pytest.raises(ValueError, match="one input size"):
        export_checkpoint(summary["checkpoint"], tmp_path / "s.onnx", "onnx", tta="scales=1,2", log=lambda m: None)
