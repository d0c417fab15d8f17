"""Static INT8 with calibration (`vitflow quantize --calibrate`): the guard picks the calibration
method on the digits run's real held-out images, the model is QDQ with calibrated ranges, and bad
calibration data gets one clear line each."""

import json

import numpy as np
import pytest
import torch

from vitflow.checkpoint import load_checkpoint
from vitflow.cli import main
from vitflow.data.sources.digits import digits_source
from vitflow.infer.calibration import calibration_images
from vitflow.infer.predict import Predictor
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel

pytest.importorskip("onnxruntime")


def _run(capsys, *args):
    code = main([*map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out.strip().splitlines()[-1]) if code == 0 else None), out.err


def test_static_int8_calibrated_and_guarded(digits_run, tmp_path, capsys):
    """Calibrated on the run's own training images (the default), guarded on its held-out split
    (the default): all three methods measured, the best kept; the file holds QDQ pairs and no
    run-time quantisation, and predicts like the float model."""
    onnx = pytest.importorskip("onnx")
    _, r, _ = digits_run
    out = tmp_path / "digits.static.onnx"
    code, q, err = _run(capsys, "quantize", r["checkpoint"], "-o", out, "--calibrate", "--calibration-images", 128)
    assert code == 0, err
    assert q["calibration_images"] == 128 and q["images"] == 359  # the run's train[80%:] split
    assert set(q["methods"]) == {"minmax", "percentile", "entropy"}
    assert q["method"] == max(q["methods"], key=q["methods"].get) and q["top1_after"] == q["methods"][q["method"]]
    assert abs(q["top1_before"] - r["test_top1"]) < 0.02 and q["drop_points"] <= 1.0
    ops = [n.op_type for n in onnx.load(str(out)).graph.node]
    assert ops.count("QuantizeLinear") >= 4 * 4 and ops.count("DequantizeLinear") >= 4 * 6  # every block's linears
    assert "DynamicQuantizeLinear" not in ops and "MatMulInteger" not in ops  # ranges fixed ahead of time

    state = load_checkpoint(r["checkpoint"])
    info = ModelInfo.from_checkpoint(state)
    x = calibration_images(None, info.preprocess, info.classes, state, 64, split="train")
    from vitflow.checkpoint import model_from_checkpoint

    with torch.no_grad():
        ref = model_from_checkpoint(state)(x)
    got = OnnxModel(out)(x)
    assert (got.argmax(1) == ref.argmax(1)).float().mean() >= 0.95
    assert 0 < (got - ref).abs().max() < 0.5 * ref.std()  # quantised (not bit-equal), close
    assert Predictor.load(out).classes == info.classes  # vitflow's metadata kept


def test_one_method_and_a_folder_of_images(digits_run, tmp_path, capsys):
    """`--method minmax` tries one method; calibration images may be a folder without classes."""
    from PIL import Image

    _, r, _ = digits_run
    src = digits_source()
    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(40):
        Image.fromarray(src.load(i).permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")
    code, q, err = _run(capsys, "quantize", r["checkpoint"], "-o", tmp_path / "m.onnx", "--calibrate", folder,
                        "--method", "minmax")
    assert code == 0, err
    assert q["calibration_images"] == 40 and list(q["methods"]) == ["minmax"] and q["drop_points"] <= 1.0


def _one_line_error(capsys, *args) -> str:
    assert main([*map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err  # one clear line
    return err


def test_bad_calibration_data_one_line_each(digits_run, tmp_path, capsys):
    from PIL import Image

    _, r, _ = digits_run
    q = ["quantize", r["checkpoint"], "-o", tmp_path / "q.onnx", "--calibrate"]
    # another class count: a folder of 3 classes that are not the digits'
    other = tmp_path / "other"
    for c in ("cat", "dog", "fox"):
        (other / "train" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8), (9, 9, 9)).save(other / "train" / c / "a.png")
    err = _one_line_error(capsys, *q, other)
    assert str(other) in err and "has 3 classes" in err and "the model 10" in err
    # an empty folder
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, *q, tmp_path / "empty")
    assert f"calibration data {tmp_path / 'empty'}: no images" in err
    # images of another size: 2x2 pictures for an 8x8 model
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        Image.new("RGB", (2, 2), (i, i, i)).save(small / f"{i}.png")
    err = _one_line_error(capsys, *q, small)
    assert "2 px on the short side" in err and "8x8" in err
    # model inputs of another size in a .npy
    np.save(tmp_path / "x.npy", np.zeros((4, 3, 32, 32), np.float32))
    err = _one_line_error(capsys, *q, tmp_path / "x.npy")
    assert "(4, 3, 32, 32)" in err and "(N, 3, 8, 8)" in err
    assert not (tmp_path / "q.onnx").exists() and not list(tmp_path.glob(".q.onnx*"))


def test_static_int8_with_the_torch_backend_is_refused(digits_run, tmp_path, capsys):
    _, r, _ = digits_run
    err = _one_line_error(capsys, "quantize", r["checkpoint"], "-o", tmp_path / "q.pt", "--backend", "torch",
                          "--calibrate")
    assert "--calibrate" in err and "dynamically" in err
    err = _one_line_error(capsys, "quantize", r["checkpoint"], "-o", tmp_path / "q.onnx", "--method", "entropy")
    assert "--calibrate" in err
