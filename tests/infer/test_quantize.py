"""Quantisation: ONNX Runtime INT8 with the top-1 guard, the PyTorch INT8 checkpoint, and FP16 /
BF16 weight casting, on a trained digits model and its real held-out test images."""

import json
from pathlib import Path

import pytest
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.data.sources.digits import digits_source
from vitflow.data.sources.splits import parse_split
from vitflow.infer import collect_images
from vitflow.infer.predict import Predictor
from vitflow.infer.quantize.dynamic import quantize_torch


@pytest.fixture(scope="module")
def digits_test_folder(tmp_path_factory):
    """The digits run's held-out split (``train[80%:]``, 359 real scans) as ``test/<class>/*.png``."""
    from PIL import Image

    src = digits_source()
    test = src.subset(parse_split("train[80%:]").select(len(src)))
    root = tmp_path_factory.mktemp("digits_data")
    for i in range(len(test)):
        folder = root / "test" / test.classes[test.labels[i]]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(test.load(i).permute(1, 2, 0).numpy()).save(folder / f"{i:04d}.png")
    return root


def _quantize(capsys, *args):
    code = main(["quantize", *map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out.strip().splitlines()[-1]) if code == 0 else None), out.err


def _outlier_checkpoint(path_in, path_out, factor=100.0):
    """The same function with badly scaled weights: in every block, the q rows of head 0 and the
    k rows of head 1 are multiplied by ``factor``, the k rows of head 0 and the q rows of head 1
    divided by it (each head's q.k is unchanged). With one scale per weight tensor the small rows
    round to zero; with one scale per output channel they do not."""
    state = torch.load(path_in, weights_only=True)
    sd = state["model"]
    for key in [k for k in sd if k.endswith("attn.qkv.weight")]:
        dim = sd[key].shape[0] // 3
        hd = dim // 2  # the digits model has 2 heads
        for name in (key, key.replace("weight", "bias")):
            t = sd[name].clone()
            t[:hd] *= factor  # q, head 0
            t[hd:dim] /= factor  # q, head 1
            t[dim:dim + hd] /= factor  # k, head 0
            t[dim + hd:2 * dim] *= factor  # k, head 1
            sd[name] = t
    torch.save(state, path_out)
    return path_out


def test_onnxruntime_int8_within_one_point(digits_run, digits_test_folder, tmp_path, capsys):
    run, r, _ = digits_run
    out = tmp_path / "digits.int8.onnx"
    code, q, _ = _quantize(capsys, r["checkpoint"], "-o", out, "--data", digits_test_folder)
    assert code == 0 and out.is_file() and q["written"]
    assert q["images"] == 359 and q["ops"]["MatMulInteger"] >= 4 * 6  # every block's linears
    assert abs(q["top1_before"] - r["test_top1"]) < 0.02  # fp32 ONNX vs the run's own evaluation
    assert q["drop_points"] <= 1.0 and q["top1_after"] > 0.8


@pytest.mark.slow
def test_guard_refuses_a_collapsing_int8_model(digits_run, digits_test_folder, tmp_path, capsys):
    run, r, _ = digits_run
    bad = _outlier_checkpoint(r["checkpoint"], tmp_path / "outliers.pt")
    x = torch.randn(16, 3, 8, 8)
    with torch.no_grad():  # the float function is unchanged
        a, b = (model_from_checkpoint(load_checkpoint(p))(x) for p in (r["checkpoint"], bad))
    assert torch.allclose(a, b, atol=1e-3)

    refused = tmp_path / "refused.onnx"
    code, _, err = _quantize(capsys, bad, "-o", refused, "--data", digits_test_folder, "--per-tensor")
    assert code == 1 and not refused.exists() and "NOT written" in err and "--max-drop 1" in err
    assert not list(tmp_path.glob(".refused*"))  # no temporary left behind

    code, q, _ = _quantize(capsys, bad, "-o", refused, "--data", digits_test_folder, "--per-tensor", "--force")
    assert code == 0 and refused.exists() and q["drop_points"] > 5  # what the guard prevented

    code, q, _ = _quantize(capsys, bad, "-o", tmp_path / "per_channel.onnx", "--data", digits_test_folder)
    assert code == 0 and q["drop_points"] <= 1.0  # per-channel weights survive the outliers


def test_torch_int8_checkpoint_round_trip(digits_run, digits_test_folder, tmp_path, capsys):
    run, r, _ = digits_run
    out = tmp_path / "digits.int8.pt"
    code, q, _ = _quantize(capsys, r["checkpoint"], "-o", out, "--backend", "torch", "--data", digits_test_folder)
    assert code == 0 and q["drop_points"] <= 1.0
    state = load_checkpoint(out)
    assert state["quantization"] == "dynamic-int8" and "optimizer" not in state
    loaded = model_from_checkpoint(state)
    fp32 = model_from_checkpoint(load_checkpoint(r["checkpoint"]))
    x = torch.randn(32, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), quantize_torch(fp32)(x))  # the saved INT8 model is the one measured
        assert (loaded(x).argmax(1) == fp32(x).argmax(1)).float().mean() >= 0.9
    assert main(["eval", str(out), "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(e["test_top1"] - r["test_top1"]) <= 0.02


def test_bf16_and_fp16_weight_casting(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / f"digits.{dtype}.pt"
        code, q, _ = _quantize(capsys, r["checkpoint"], "-o", out, "--backend", "torch", "--dtype", dtype)
        assert code == 0
        state = load_checkpoint(out)
        assert state["weights_dtype"] == dtype and state["model"]["head.weight"].dtype == torch_dtype
        assert out.stat().st_size < 0.6 * sum(v.numel() * 4 for v in state["model"].values()) + 50_000
    refs = collect_images(sorted(Path(r["samples"]).glob("*.png")))
    fp32 = Predictor.load(r["checkpoint"], "cpu", "fp32")
    bf16 = Predictor.load(tmp_path / "digits.bf16.pt", "cpu", "bf16")
    assert bf16.model.head.weight.dtype == torch.bfloat16
    top_fp32 = [x["top"][0] for x in fp32.predict_refs(refs, 1)]
    top_bf16 = [x["top"][0] for x in bf16.predict_refs(refs, 1)]
    assert sum(p["class"] == q["class"] for p, q in zip(top_fp32, top_bf16)) >= 9
    assert max(abs(p["prob"] - q["prob"]) for p, q in zip(top_fp32, top_bf16)) < 0.05
    # fp16 inference needs CUDA; on the CPU it is a clear user error
    if not torch.cuda.is_available():
        assert main(["predict", str(tmp_path / "digits.fp16.pt"), r["samples"], "--precision", "fp16"]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_output_name_and_split_without_data_are_user_errors(digits_run, tmp_path, capsys):
    _, r, _ = digits_run
    assert main(["quantize", r["checkpoint"], "-o", str(tmp_path / "q.pt")]) == 2  # onnxruntime writes .onnx
    assert "writes a .onnx file" in capsys.readouterr().err and not (tmp_path / "q.pt").exists()
    assert main(["quantize", r["checkpoint"], "-o", str(tmp_path / "q.onnx"), "--split", "test[:10]"]) == 2
    assert "--data" in capsys.readouterr().err and not (tmp_path / "q.onnx").exists()


def test_data_may_be_the_split_folder_itself(digits_run, digits_test_folder, tmp_path, capsys):
    """``--data PHOTOS/test`` (class folders at its root) measures all its images: the same as the
    test split of ``--data PHOTOS``."""
    run, r, _ = digits_run
    code, whole, _ = _quantize(capsys, r["checkpoint"], "-o", tmp_path / "a.pt", "--backend", "torch", "--data",
                               digits_test_folder)
    code2, split, _ = _quantize(capsys, r["checkpoint"], "-o", tmp_path / "b.pt", "--backend", "torch", "--data",
                                digits_test_folder / "test")
    assert code == code2 == 0 and split["images"] == whole["images"] == 359
    assert split["top1_before"] == whole["top1_before"] and split["top1_after"] == whole["top1_after"]
