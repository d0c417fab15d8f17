"""`vitflow bench infer`: every path runs, and the --json last line has exactly the issue's format."""

import json

from vitflow.cli import main
from vitflow.infer.bench import PATHS, Timing


def test_timing_summary_percentiles():
    t = Timing(latencies_ms=[float(v) for v in range(1, 11)], throughputs=[100.0, 300.0, 200.0])
    assert t.summary() == {"latency_ms_p50": 5.5, "latency_ms_p90": 9.0, "throughput_ips": 200.0}


def test_bench_infer_json_format(digits_run, capsys):
    run, r, _ = digits_run
    code = main(["bench", "infer", r["checkpoint"], "--repeats", "2", "--latency-calls", "3", "--min-time", "0.05",
                 "--json"])
    assert code == 0
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1  # with --json stdout is the JSON line alone; the table goes to stderr
    result = json.loads(out[-1])
    assert list(result) == list(PATHS) == ["timm_eager_fp32", "timm_eager_bf16", "eager_fp32", "eager_bf16",
                                           "compiled", "onnxruntime_fp32", "onnxruntime_int8"]
    for v in result.values():
        assert set(v) == {"latency_ms_p50", "latency_ms_p90", "throughput_ips"}
        assert 0 < v["latency_ms_p50"] <= v["latency_ms_p90"] and v["throughput_ips"] > 0
    table = captured.err
    assert "best vitflow path" in table and "timm's best path" in table
