"""`vitflow bench infer`: every path runs, and the --json last line has exactly the issue's format."""

import json

import pytest
import torch

from vitflow.cli import main
from vitflow.data.transforms import Preprocess
from vitflow.infer.bench import infer as bench
from vitflow.infer.bench.infer import PATHS, build_paths, select_paths
from vitflow.infer.bench.timing import Timing
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
    assert select_paths(None) == tuple(PATHS) and len(PATHS) == 23
    assert select_paths("openvino_int8*, timm_openvino_int8") == ("timm_openvino_int8", "openvino_int8",
                                                                  "openvino_int8_tuned")
    assert select_paths("*onnxruntime_int8_static") == ("timm_onnxruntime_int8_static", "onnxruntime_int8_static")
    with pytest.raises(ValueError, match="unknown benchmark path 'tensorrt'"):
        select_paths("eager_fp32,tensorrt")


@pytest.mark.slow
def test_peers_and_vitflow_side_by_side_with_top1(digits_run, capsys, monkeypatch):
    """The peers' OpenVINO INT8 and vitflow's OpenVINO / static INT8 paths, with each one's top-1
    on the run's real held-out images (in batches of the timed size: ONNX Runtime keeps the memory
    of the largest batch it saw); the summary compares vitflow's fastest with OpenVINO INT8 and
    with OpenVINO's best on vitflow's own export."""
    pytest.importorskip("openvino")
    _, r, _ = digits_run
    batches, loader = [], bench.eval_loader
    monkeypatch.setattr(bench, "eval_loader", lambda src, pp, n, *a: batches.append(n) or loader(src, pp, n, *a))
    code = main(["bench", "infer", r["checkpoint"], "--repeats", "1", "--latency-calls", "2", "--min-time", "0.05",
                 "--paths", "eager_fp32,timm_openvino_int8,openvino_int8_tuned,onnxruntime_int8_static,ov_best_*",
                 "--data", "--calibration-images", "64", "--batch-size", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert batches == [8]
    result = json.loads(captured.out.strip().splitlines()[-1])
    top1 = {k: v["top1"] for k, v in result.items()}
    assert abs(top1["eager_fp32"] - r["test_top1"]) < 0.005  # the run's own figure on the same 359 images
    assert all(abs(v - top1["eager_fp32"]) <= 0.03 for v in top1.values())  # same weights: timm's too
    assert "= " in captured.err and "x timm_openvino_int8" in captured.err
    # the yardstick that matters: OpenVINO used well on vitflow's own export, the better of its two hints
    assert "x ov_best_" in captured.err and {"ov_best_throughput", "ov_best_latency"} <= set(result)


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


@pytest.mark.slow
def test_token_merging_paths_run_the_merged_model_and_the_guard_keeps_its_drop(digits_run, tmp_path):
    """The tome_* paths run the merged model: its ONNX export gives the eager merged model's
    logits on real held-out images (1e-4);
    the guard's choice of r keeps top-1 within --max-drop and stops at the first r past it."""
    pytest.importorskip("onnxruntime")
    from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
    from vitflow.infer.calibration import calibration_images, checkpoint_split
    from vitflow.infer.token_merge import choose_token_merge

    _, r, _ = digits_run
    state = load_checkpoint(r["checkpoint"])
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    images = calibration_images(None, info.preprocess, info.classes, state, 64, split="test")
    paths = ("eager_fp32", "tome_eager_fp32", "tome_onnxruntime_fp32")
    runners, notes = build_paths(model, info, tmp_path, paths, lambda: images, log=lambda m: None, token_merge=3)
    assert notes["tome_eager_fp32"].endswith("(r=3)") and runners["tome_eager_fp32"].token_merge == 3
    with torch.no_grad():
        plain, merged, onnx = (runners[k](images) for k in paths)
    assert not torch.allclose(plain, merged, atol=1e-3)  # merging is on ...
    torch.testing.assert_close(onnx, merged, atol=1e-4, rtol=1e-4)  # ... and exported as it runs eagerly

    source = checkpoint_split(state)
    choice = choose_token_merge(model, source, info, max_drop=2.0, candidates=[1, 2, 4, 6], log=lambda m: None)
    kept = [c for c in choice["curve"] if c["r"] <= choice["r"]]
    assert all(c["drop_points"] <= 2.0 for c in kept)
    assert choice["curve"][-1]["r"] == choice["r"] or choice["curve"][-1]["drop_points"] > 2.0
    assert choice["images"] == len(source) and 0 < choice["before"] <= 1
