"""OpenVINO as a deployment backend: the IR of `vitflow export --format openvino` runs in
OpenVINO's own runtime with vitflow's logits (fp32, 1e-4), carries vitflow's metadata, serves
`predict` / `eval`; a fixed-batch IR; NNCF INT8 behind the accuracy guard; an op OpenVINO cannot
convert is one clear line; `vitflow serve` on the IR (a real server on 127.0.0.1)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.infer.calibration import checkpoint_split, sample_images
from vitflow.infer.predict import Predictor, collect_images
from vitflow.infer.runtimes.onnx import ModelInfo, set_metadata
from vitflow.infer.runtimes.openvino import OpenVinoModel

ov = pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def exported(digits_run, tmp_path_factory):
    """The digits run exported to an IR: ``(checkpoint, ir path, state, real images)``."""
    _, r, _ = digits_run
    xml = tmp_path_factory.mktemp("ov") / "digits.xml"
    assert main(["export", r["checkpoint"], "--format", "openvino", "-o", str(xml), "--verify-data", r["samples"]]) == 0
    state = load_checkpoint(r["checkpoint"])
    info = ModelInfo.from_checkpoint(state)
    return r, xml, state, sample_images(checkpoint_split(state), info.preprocess, 32)


def test_ir_runs_in_openvinos_own_runtime_with_vitflows_logits(exported):
    r, xml, state, x = exported
    assert xml.is_file() and xml.with_suffix(".bin").is_file()
    core = ov.Core()
    model = core.read_model(str(xml))  # OpenVINO's runtime alone, no vitflow wrapper
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = compiled(x.numpy())[0]
    with torch.no_grad():
        want = model_from_checkpoint(state)(x).numpy()
    assert want.std() > 0.5 and np.abs(got - want).max() < 1e-4
    assert json.loads(model.get_rt_info(["vitflow", "classes"]).astype(str)) == list(state["classes"])
    assert json.loads(model.get_rt_info(["vitflow", "preprocess"]).astype(str))["image_size"] == 8
    assert model.input(0).get_partial_shape()[0].is_dynamic  # any batch


def test_predict_and_eval_take_the_ir(exported, capsys):
    r, xml, _, _ = exported
    refs = sorted(str(p) for p in Path(r["samples"]).glob("*.png"))
    ours = Predictor.load(xml)
    theirs = Predictor.load(r["checkpoint"], "cpu")
    a = [p["top"][0] for p in ours.predict_refs(collect_images(refs), 1)]
    b = [p["top"][0] for p in theirs.predict_refs(collect_images(refs), 1)]
    assert [p["class"] for p in a] == [p["class"] for p in b]
    assert max(abs(p["prob"] - q["prob"]) for p, q in zip(a, b)) < 1e-5
    import vitflow

    one = vitflow.load(str(xml)).predict(refs[0], topk=1)  # the Python API takes the IR too
    assert one["top"][0]["class"] == a[0]["class"] and abs(one["top"][0]["prob"] - a[0]["prob"]) < 1e-6
    assert main(["eval", str(xml), "data.source=digits", "data.test_split=train[80%:]", "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["weights"] == "exported" and abs(e["test_top1"] - r["test_top1"]) < 0.005
    assert main(["eval", str(xml)]) == 2
    assert "carries no data path" in capsys.readouterr().err


def test_fixed_batch_ir_takes_any_batch(exported, tmp_path):
    r, xml, _, x = exported
    fixed = tmp_path / "b4.xml"
    assert main(["export", r["checkpoint"], "--format", "openvino", "--batch", "4", "-o", str(fixed),
                 "--verify-data", r["samples"]]) == 0
    assert list(ov.Core().read_model(str(fixed)).input(0).get_partial_shape().to_shape()) == [4, 3, 8, 8]
    a, b = Predictor.load(fixed).model(x[:7]), Predictor.load(xml).model(x[:7])  # 7: two batches, one padded
    assert a.shape == (7, 10) and torch.allclose(a, b, atol=1e-5)


def test_throughput_hint_runs_a_batch_too_small_to_split_on_all_threads(exported):
    _, xml, _, x = exported
    split, whole = OpenVinoModel(xml, hint="throughput", static_shapes=True), OpenVinoModel(xml)
    for n in (1, 2 * split.streams + 1):  # one image: a latency-hint copy; a batch: split over the streams
        assert torch.allclose(split(x[:n]), whole(x[:n]), atol=1e-5)
    assert {hint for _, _, hint in split.requests} == ({"latency", "throughput"} if split.streams > 1 else {"throughput"})
    assert {(n, hint) for n, _, hint in split.requests if n == 1} == {(1, "latency" if split.streams > 1 else "throughput")}


def test_quantize_refuses_an_ir_naming_its_checkpoint(exported, tmp_path, capsys):
    _, xml, _, _ = exported
    assert main(["quantize", str(xml), "--backend", "openvino", "-o", str(tmp_path / "q.xml")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {xml} is an OpenVINO IR; quantize takes the checkpoint (or "
                                               "vitflow .onnx) it came from: vitflow quantize RUN --backend openvino "
                                               "-o digits.int8.xml")


def test_nncf_int8_behind_the_guard(exported, tmp_path, capsys):
    r, xml, state, x = exported
    out = tmp_path / "digits.int8.xml"
    assert main(["quantize", r["checkpoint"], "--backend", "openvino", "-o", str(out), "--calibration-images", "64",
                 "--json"]) == 0
    q = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert q["method"] == "nncf" and q["images"] == 359 and q["drop_points"] <= 1.0
    ops = {op.get_type_name() for op in ov.Core().read_model(str(out)).get_ops()}
    assert "FakeQuantize" in ops or "FakeConvert" in ops  # INT8 regions
    int8, fp32 = Predictor.load(out).model(x), Predictor.load(xml).model(x)
    assert (int8.argmax(1) == fp32.argmax(1)).float().mean() >= 0.9 and not torch.equal(int8, fp32)


def test_an_op_openvino_cannot_convert_is_one_line(exported, tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    r, _, state, _ = exported
    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 8, 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])
    node = helper.make_node("QAttention", ["pixel_values"], ["logits"], domain="com.microsoft", name="attn")
    graph = helper.make_graph([node], "g", [x], [y])
    bad = tmp_path / "fused.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(bad))
    set_metadata(bad, ModelInfo.from_checkpoint(state).to_metadata())
    assert main(["export", str(bad), "--format", "openvino", "-o", str(tmp_path / "x.xml"),
                 "--verify-data", r["samples"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"cannot convert {bad}: no conversion for com.microsoft.QAttention" in err
    assert not (tmp_path / "x.xml").exists()


def test_serve_answers_from_the_ir_as_predict_does(exported, tmp_path, capsys):
    """`vitflow serve model.xml` (backend auto -> openvino) answers like `vitflow predict` on the
    IR; /v1/embed is refused (the IR holds only the logits); a checkpoint is not an IR."""
    httpx = pytest.importorskip("httpx")
    from serve_helpers import Served

    r, xml, _, _ = exported
    files = sorted(Path(r["samples"]).glob("*.png"))[:3]
    served_as = Predictor.from_openvino(xml, "tuned", static_shapes=False)  # the settings serve runs an IR with
    expected = list(served_as.predict_refs(collect_images([str(f) for f in files]), topk=3))
    s = Served(xml, "--threads", "1", log=tmp_path / "serve.log")
    try:
        for f, want in zip(files, expected):
            got = httpx.post(s.url + "/v1/classify?top_k=3", content=f.read_bytes(),
                             headers={"Content-Type": "image/png"})
            assert got.status_code == 200, got.text
            top = got.json()["predictions"][0]["top"]
            assert [t["class"] for t in top] == [t["class"] for t in want["top"]]
            assert max(abs(a["prob"] - b["prob"]) for a, b in zip(top, want["top"])) < 1e-6
        e = httpx.post(s.url + "/v1/embed", content=files[0].read_bytes(), headers={"Content-Type": "image/png"})
        assert e.status_code == 501 and "exported model" in e.text
    finally:
        assert s.stop() == 0, s.log.read_text()
    assert "backend openvino with vitflow's tuned settings" in s.log.read_text()  # the choice, said
    assert main(["serve", r["checkpoint"], "--backend", "openvino", "--port", "1"]) == 2
    assert "is not an OpenVINO IR" in capsys.readouterr().err
