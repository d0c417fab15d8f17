"""Export: ONNX parity on real images (one export, batch sizes 1 and 7), fusions, TorchScript /
ExportedProgram, ONNX prediction, and the bad-input errors."""

import json
from pathlib import Path

import onnx
import pytest
import torch

from helpers import CIFAR_TAR, IMAGENET_TAR, need
from vitflow.cli import main
from vitflow.data import open_split
from vitflow.data.transforms import Preprocess
from vitflow.infer.calibration import images_from_files, sample_images
from vitflow.infer.export.formats import (
    export_onnx,
    export_program,
    export_torchscript,
    load_exported,
    optimize_onnx,
    verify,
)
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel
from vitflow.models import create_model

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _info(model_name, classes, pp):
    return ModelInfo(classes, pp, {"name": model_name, "num_classes": len(classes)})


@pytest.fixture(scope="module")
def cifar_case(tmp_path_factory):
    """vit_cifar_patch4_32 (random init), 7 real CIFAR-10 test images and one ONNX export."""
    torch.manual_seed(1)
    model = create_model("vit_cifar_patch4_32", num_classes=10).eval()
    pp = Preprocess(32, 1.0, "bicubic", CIFAR_MEAN, CIFAR_STD)
    test = open_split(need(CIFAR_TAR), "test[:7]")
    x = sample_images(test, pp, n=7)
    info = _info("vit_cifar_patch4_32", test.classes, pp)
    path = export_onnx(model, tmp_path_factory.mktemp("cifar") / "cifar.onnx", info)
    return model, x, info, path


@pytest.mark.slow
def test_onnx_parity_vit_small_224_on_imagenet_photos(tmp_path):
    """A vit_small-sized model at 224 (random init) on 7 real ImageNet photos: ONE export with a
    dynamic batch, run at batch 1 and 7 by ONNX Runtime, max |logit diff| <= 1e-4."""
    torch.manual_seed(0)
    model = create_model("vit_small_patch16_224", num_classes=1000).eval()
    pp = Preprocess(224, 0.875)
    x = images_from_files([str(need(IMAGENET_TAR))], pp, n=7)
    assert x.shape == (7, 3, 224, 224) and x.std() > 0.5  # real, normalised photos
    path = export_onnx(model, tmp_path / "vit_small.onnx", _info("vit_small_patch16_224", [f"c{i}" for i in range(1000)], pp))

    proto = onnx.load(str(path), load_external_data=False)
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 224, 224]  # symbolic batch
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 17
    ort_model = OnnxModel(path)
    check = verify(model, ort_model, x, batch_sizes=(1, 7), tolerance=1e-4)
    assert check.ok, check.summary()
    assert set(check.max_abs_diff) == {1, 7} and check.worst <= 1e-4
    with torch.no_grad():
        logits = model(x)
    assert len(set(logits.argmax(1).tolist())) > 1  # not a degenerate comparison
    info = ort_model.info()
    assert info.preprocess == pp and len(info.classes) == 1000


def test_onnx_parity_cifar_variant(cifar_case):
    model, x, info, path = cifar_case
    check = verify(model, OnnxModel(path), x, batch_sizes=(1, 7), tolerance=1e-4)
    assert check.ok and check.worst <= 1e-4, check.summary()
    assert all(a == 1.0 for a in check.argmax_agree.values())


def test_onnx_fusions_keep_parity(cifar_case, tmp_path):
    model, x, info, path = cifar_case
    gpu = optimize_onnx(path, tmp_path / "gpu.onnx", "gpu")
    assert gpu.get("Attention", 0) >= 8 and gpu.get("SkipLayerNormalization", 0) >= 17  # 9 blocks
    cpu = optimize_onnx(path, tmp_path / "cpu.onnx", "cpu")
    assert "Attention" not in cpu and cpu.get("LayerNormalization", 0) == 19
    for p in ("gpu.onnx", "cpu.onnx"):
        fused = OnnxModel(tmp_path / p)
        assert verify(model, fused, x, (1, 7), 1e-4).ok
        assert fused.info().classes == info.classes  # metadata survives the optimizer


def test_torchscript_and_exported_program_parity(cifar_case, tmp_path):
    model, x, info, _ = cifar_case
    for fmt, fn, name in (("torchscript", export_torchscript, "m.ts"), ("exported-program", export_program, "m.pt2")):
        fn(model, tmp_path / name, info)
        loaded, loaded_info = load_exported(tmp_path / name, fmt)
        check = verify(model, loaded, x, (1, 7), 1e-4)
        assert check.ok, (fmt, check.summary())
        assert loaded_info.classes == info.classes and loaded_info.preprocess == info.preprocess


def test_verify_catches_a_wrong_export(cifar_case):
    model, x, _, path = cifar_case
    other = create_model("vit_cifar_patch4_32", num_classes=10).eval()  # different random weights
    check = verify(model, other, x, (1, 7), 1e-4)
    assert not check.ok and check.worst > 1e-3


def test_export_cli_then_predict_with_onnx(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    out = tmp_path / "digits.onnx"
    assert main(["export", r["checkpoint"], "-o", str(out), "--optimize", "--target", "cpu", "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["ok"] and e["images"] == 8 and max(e["max_abs_diff"].values()) <= 1e-4
    assert set(e["max_abs_diff"]) == {"1", "7"} and e["fused"]

    folder = tmp_path / "imgs"
    folder.mkdir()
    samples = sorted(Path(r["samples"]).glob("*.png"))
    for p in samples:
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "zz_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    assert main(["predict", str(out), str(folder), "--json", "--topk", "3"]) == 0
    cap = capsys.readouterr()
    rows = [json.loads(line) for line in cap.out.strip().splitlines()]
    assert len(rows) == 11 and "zz_broken.png" in rows[-1]["path"] and "cannot decode" in rows[-1]["error"]
    assert "1 of 11" in cap.err
    assert main(["predict", r["checkpoint"], str(folder), "--json", "--topk", "3"]) == 0
    ref = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    for a, b in zip(rows[:-1], ref[:-1]):  # ONNX and PyTorch agree image by image
        assert a["top"][0]["class"] == b["top"][0]["class"]
        assert abs(a["top"][0]["prob"] - b["top"][0]["prob"]) < 1e-4

    assert main(["predict", str(out), str(folder), "--csv", "--topk", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "path,rank,class,index,prob,error" and len(lines) == 1 + 10 * 2 + 1
    assert lines[1].split(",")[1] == "1" and lines[2].split(",")[1] == "2"
    assert "zz_broken.png,,,,," in lines[-1] and "cannot decode" in lines[-1]


def test_bad_inputs_are_named(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    good = tmp_path / "good.onnx"
    assert main(["export", r["checkpoint"], "-o", str(good)]) == 0
    capsys.readouterr()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    assert main(["predict", str(truncated), r["samples"]]) == 2
    assert "truncated.onnx" in capsys.readouterr().err
    assert main(["quantize", str(truncated), "-o", str(tmp_path / "q.onnx")]) == 2
    assert "truncated.onnx" in capsys.readouterr().err

    state = torch.load(r["checkpoint"], weights_only=True)
    state["model_args"] = {**state["model_args"], "name": "vit_cifar_patch4_32", "img_size": 32}
    wrong = tmp_path / "incompatible.pt"
    torch.save(state, wrong)
    for cmd in (["export", str(wrong), "-o", str(tmp_path / "x.onnx")], ["predict", str(wrong), r["samples"]],
                ["quantize", str(wrong), "-o", str(tmp_path / "x.int8.onnx")], ["bench", "infer", str(wrong)]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert "incompatible.pt" in err and "does not fit" in err

    assert main(["export", r["checkpoint"], "--format", "tensorrt", "-o", str(tmp_path / "m.engine")]) == 3
    err = capsys.readouterr().err
    assert "TensorRT" in err and ("tensorrt" in err or "GPU" in err)


def test_opset_is_honoured_or_refused_never_changed(digits_run, tmp_path, capsys):
    _, r, _ = digits_run
    out = tmp_path / "m21.onnx"
    assert main(["export", r["checkpoint"], "-o", str(out), "--opset", "21"]) == 0
    assert [o.version for o in onnx.load(str(out)).opset_import if o.domain in ("", "ai.onnx")] == [21]
    capsys.readouterr()
    assert main(["export", r["checkpoint"], "-o", str(tmp_path / "m17.onnx"), "--opset", "17"]) == 2
    err = capsys.readouterr().err
    assert "--opset 17 is not supported: vitflow exports opsets 18 to" in err
    assert not (tmp_path / "m17.onnx").exists()
