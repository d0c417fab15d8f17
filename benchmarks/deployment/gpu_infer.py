"""GPU inference check, one short run (< 3 minutes on one modern GPU): FP16 inference timing and,
when ``tensorrt`` is importable, a TensorRT FP16 engine built from vitflow's ONNX export, checked
against PyTorch and timed.

    PYTHONPATH=src python benchmarks/deployment/gpu_infer.py [--checkpoint CKPT] [--model vit_small_patch16_224] [--json]

Without ``--checkpoint`` a randomly initialised model of ``--model`` is used (speed and numerical
agreement do not depend on training). Every section reports its own failure and the script goes
on, so one run shows everything that works. Each timing is the median of ``--repeats`` runs after
warm-up, synchronised with ``torch.cuda.synchronize``; fp32 runs with TF32 matmuls disabled.
The last line (``--json``) maps each path to ``{"latency_ms_p50", "throughput_ips"}`` plus the
agreement figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def timed(fn, x: torch.Tensor, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``fn(x)`` (CUDA-synchronised)."""
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def measure(name: str, fn, size: int, batch: int, repeats: int, results: dict) -> None:
    x1 = torch.randn(1, 3, size, size, device="cuda")
    xb = torch.randn(batch, 3, size, size, device="cuda")
    with torch.inference_mode():
        for x in (x1, x1, xb, xb):
            fn(x)
        lat = timed(fn, x1, 50, repeats)
        tput = batch / timed(fn, xb, 10, repeats)
    results[name] = {"latency_ms_p50": round(lat * 1e3, 3), "throughput_ips": round(tput, 1)}
    print(f"{name:22s} batch-1 {lat * 1e3:8.3f} ms   batch-{batch} {tput:9.1f} img/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a vitflow checkpoint (default: random init of --model)")
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
    from vitflow.data.transforms import Preprocess
    from vitflow.infer.runtimes.onnx import ModelInfo
    from vitflow.models import create_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if args.checkpoint:
        state = load_checkpoint(args.checkpoint)
        model, info = model_from_checkpoint(state), ModelInfo.from_checkpoint(state)
    else:
        model = create_model(args.model, num_classes=1000).eval()
        info = ModelInfo([f"class{i}" for i in range(1000)], Preprocess(model.img_size), {"name": args.model})
    size = info.preprocess.image_size
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.checkpoint or args.model} at {size} px")
    results: dict = {}
    model = model.cuda().eval()
    x = torch.randn(16, 3, size, size, device="cuda")
    with torch.inference_mode():
        ref = model(x).float()

    # --- PyTorch eager: fp32, fp16 weights, bf16 weights -------------------------------------
    measure("torch_eager_fp32", model, size, args.batch_size, args.repeats, results)
    for name, dtype in (("torch_eager_fp16", torch.float16), ("torch_eager_bf16", torch.bfloat16)):
        try:
            m = copy.deepcopy(model).to(dtype).eval()
            with torch.inference_mode():
                out = m(x.to(dtype)).float()
            results[f"{name}_max_abs_diff"] = float((out - ref).abs().max())
            results[f"{name}_argmax_agree"] = float((out.argmax(1) == ref.argmax(1)).float().mean())
            measure(name, lambda t, m=m, d=dtype: m(t.to(d)), size, args.batch_size, args.repeats, results)
        except Exception:
            traceback.print_exc()

    # --- TensorRT FP16 engine from the ONNX export ---------------------------------------------
    from vitflow.infer.export.formats import export_onnx, verify
    from vitflow.infer.runtimes.tensorrt import TensorRTModel, build_tensorrt_engine, tensorrt_available

    reason = tensorrt_available()
    if reason:
        print(f"TensorRT skipped: {reason}")
        results["tensorrt"] = f"skipped: {reason}"
    else:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                cpu_model = copy.deepcopy(model).cpu()
                onnx_path = export_onnx(cpu_model, Path(tmp) / "model.onnx", info)
                print(f"ONNX export {time.perf_counter() - t0:.1f} s")
                build = build_tensorrt_engine(onnx_path, Path(tmp) / "model.engine", fp16=True,
                                              batch_sizes=(1, args.batch_size, max(args.batch_size, 128)))
                print(f"TensorRT FP16 engine built in {build['build_s']:.1f} s ({build['bytes'] / 2**20:.1f} MiB)")
                results["tensorrt_build_s"] = round(build["build_s"], 1)
                trt_model = TensorRTModel(build["engine"])
                check = verify(cpu_model, lambda t: trt_model(t).cpu(), x.cpu(), (1, 7), tolerance=0.1)
                print(f"TensorRT vs PyTorch fp32: {check.summary()}")
                results["tensorrt_fp16_max_abs_diff"] = check.worst
                measure("tensorrt_fp16", trt_model, size, args.batch_size, args.repeats, results)
        except Exception:
            traceback.print_exc()
            results["tensorrt"] = "failed (traceback above)"
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
