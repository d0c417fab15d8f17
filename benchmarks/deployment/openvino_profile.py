"""Where OpenVINO spends the time of a checkpoint's INT8 IR: per node type, at batch 1 and at a
batch, with and without token merging, from OpenVINO's own per-node counters (``PERF_COUNT``).

    python benchmarks/deployment/openvino_profile.py RUN_OR_CHECKPOINT [--token-merge R] [--batch-size 16]
        [--calls 100] [--threads 2] [--top 14]

Each IR is vitflow's export quantised by NNCF (the ``openvino_int8_tuned`` / ``ov_best_*`` IR of
``vitflow bench infer``) on 128 of the checkpoint's training images, reshaped to a static batch and
compiled with the latency hint and bf16 float layers where the CPU has them. A line per IR and batch:
the summed node time per call (microseconds; the runtime's own overhead between nodes is not in it)
and the node types that take most of it, with their count. The nodes' total is a profile, not a
speed figure: ``vitflow bench infer`` measures speed. The CPU flags are printed.

Smoke run: ``vitflow train train.total_steps=40 train.run_dir=/tmp/d``, then
``python benchmarks/deployment/openvino_profile.py /tmp/d --token-merge 2 --calls 5``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import tempfile
from pathlib import Path

import numpy as np
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.infer.bench.timing import cpu_flags
from vitflow.infer.calibration import calibration_images
from vitflow.infer.export.formats import export_onnx
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.infer.runtimes.openvino import convert_onnx, nncf_quantize
from vitflow.runtime import cpu_bf16_supported


def node_times(model, images: np.ndarray, calls: int, threads: int) -> tuple[dict[str, float], dict[str, int]]:
    """``({node type: microseconds per call}, {node type: nodes executed})`` of an ``openvino.Model``
    on ``images`` (its batch), after 10 warm-up calls."""
    import openvino as ov

    model = model.clone()
    model.reshape({model.inputs[0]: list(images.shape)})
    compiled = ov.Core().compile_model(model, "CPU", {
        "PERF_COUNT": "YES", "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
        "INFERENCE_PRECISION_HINT": "bf16" if cpu_bf16_supported() else "f32"})
    request = compiled.create_infer_request()
    for _ in range(10):
        request.infer([images])
    time_us, count = collections.Counter(), collections.Counter()
    for _ in range(calls):
        request.infer([images])
        for node in request.get_profiling_info():
            if node.status.name == "EXECUTED":
                time_us[node.node_type] += node.real_time.total_seconds() * 1e6 / calls
                count[node.node_type] += 1
    return dict(time_us), {k: v // calls for k, v in count.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--token-merge", type=int, default=0, help="also profile the IR merging R tokens a block")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=14, help="node types printed per line")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    state = load_checkpoint(args.checkpoint)
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    images = calibration_images(None, info.preprocess, info.classes, state, 128)
    variants = {"unmerged": model}
    if args.token_merge:
        variants[f"r={args.token_merge}"] = copy.deepcopy(model)
        variants[f"r={args.token_merge}"].set_token_merge(args.token_merge)
    print(f"CPU flags: {' '.join(cpu_flags()) or 'unknown'}; {args.threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in variants.items():
            onnx = Path(tmp) / f"{name.replace('=', '')}.onnx"
            export_onnx(m, onnx, info)
            ir = nncf_quantize(convert_onnx(onnx), images)
            for batch in (1, args.batch_size):
                x = np.ascontiguousarray(images[:1].expand(batch, -1, -1, -1).numpy())
                time_us, count = node_times(ir, x, args.calls, args.threads)
                top = sorted(time_us.items(), key=lambda kv: -kv[1])[:args.top]
                print(f"{name} b{batch}: nodes {sum(time_us.values()):.0f} us a call; "
                      + ", ".join(f"{k} {v:.0f} ({count[k]})" for k, v in top))


if __name__ == "__main__":
    main()
