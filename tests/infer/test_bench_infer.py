"""`vitflow bench infer`: every path runs, and the --json last line has exactly the issue's format."""

import json

import pytest
import torch

from vitflow.cli import main
from vitflow.data.transforms import Preprocess
from vitflow.infer.bench import infer as bench
from vitflow.infer.bench.infer import PATHS, Timing, build_paths, select_paths
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.models import create_model

pytest.importorskip("timm")


def test_timing_summary_percentiles():
    t = Timing(latencies_ms=[float(v) for v in range(1, 11)], throughputs=[100.0, 300.0, 200.0])
    assert t.summary() == {"latency_ms_p50": 5.5, "latency_ms_p90": 9.0, "throughput_ips": 200.0}


def test_bench_infer_json_format(digits_run, capsys):
    run, r, _ = digits_run
    code = main(["bench", "infer", r["checkpoint"], "--repeats", "2", "--latency-calls", "3", "--min-time", "0.05",
                 "--paths", "timm_eager_*,eager_*,onnxruntime_int8", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1  # with --json stdout is the JSON line alone; the table goes to stderr
    result = json.loads(out[-1])
    assert list(result) == ["timm_eager_fp32", "timm_eager_bf16", "eager_fp32", "eager_bf16", "onnxruntime_int8"]
    for v in result.values():
        assert set(v) == {"latency_ms_p50", "latency_ms_p90", "throughput_ips"}
        assert 0 < v["latency_ms_p50"] <= v["latency_ms_p90"] and v["throughput_ips"] > 0
    table = captured.err
    assert "vitflow's fastest" in table and "timm_eager" in table and "CPU flags:" in table


def test_path_selection_by_names_and_patterns():
    assert select_paths(None) == tuple(PATHS) and len(PATHS) == 18
    assert select_paths("openvino_int8*, timm_openvino_int8") == ("timm_openvino_int8", "openvino_int8",
                                                                  "openvino_int8_tuned")
    assert select_paths("*onnxruntime_int8_static") == ("timm_onnxruntime_int8_static", "onnxruntime_int8_static")
    with pytest.raises(ValueError, match="unknown benchmark path 'tensorrt'"):
        select_paths("eager_fp32,tensorrt")


@pytest.mark.slow
def test_peers_and_vitflow_side_by_side_with_top1(digits_run, capsys, monkeypatch):
    """The peers' OpenVINO INT8 and vitflow's OpenVINO / static INT8 paths, with each one's top-1
    on the run's real held-out images (in batches of the timed size: ONNX Runtime keeps the memory
    of the largest batch it saw); the summary compares vitflow's fastest with OpenVINO INT8."""
    pytest.importorskip("openvino")
    _, r, _ = digits_run
    batches, loader = [], bench.eval_loader
    monkeypatch.setattr(bench, "eval_loader", lambda src, pp, n, *a: batches.append(n) or loader(src, pp, n, *a))
    code = main(["bench", "infer", r["checkpoint"], "--repeats", "1", "--latency-calls", "2", "--min-time", "0.05",
                 "--paths", "eager_fp32,timm_openvino_int8,openvino_int8_tuned,onnxruntime_int8_static",
                 "--data", "--calibration-images", "64", "--batch-size", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert batches == [8]
    result = json.loads(captured.out.strip().splitlines()[-1])
    top1 = {k: v["top1"] for k, v in result.items()}
    assert abs(top1["eager_fp32"] - r["test_top1"]) < 0.005  # the run's own figure on the same 359 images
    assert all(abs(v - top1["eager_fp32"]) <= 0.03 for v in top1.values())  # same weights: timm's too
    assert "= " in captured.err and "x timm_openvino_int8" in captured.err


@pytest.mark.parametrize("name,sizes", [("vit_small_patch16_dinov3_qkvb", dict(img_size=32, embed_dim=64, num_heads=2)),
                                        ("vit_base_patch16_siglip_224", dict(img_size=32, embed_dim=64, num_heads=2,
                                                                             mlp_ratio=2.0))])
def test_timm_reference_is_the_same_name_model(name, sizes, tmp_path):
    """For the pretrained families the timm path is timm's model of the same name, told the same
    sizes, with vitflow's weights: both compute the same function (1e-5)."""
    torch.manual_seed(0)
    args = {"name": name, "num_classes": 3, "depth": 2, **sizes}
    model = create_model(**args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # off the initial values (near-zero head, LayerScale)
    info = ModelInfo(["a", "b", "c"], Preprocess(32), args)
    runners, notes = build_paths(model.eval(), info, tmp_path, ("timm_eager_fp32", "eager_fp32"))
    timm_ref = runners["timm_eager_fp32"]
    assert type(timm_ref).__module__.startswith("timm.") and timm_ref.default_cfg["architecture"] == name
    assert notes["timm_eager_fp32"].startswith(f"timm {type(timm_ref).__name__}, fp32")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = runners["eager_fp32"](x)
        assert want.abs().max() > 0.1 and torch.allclose(timm_ref(x), want, atol=1e-5, rtol=1e-5)
