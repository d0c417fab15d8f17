"""What each OpenVINO setting buys on this CPU: one checkpoint's INT8 IR (NNCF, calibrated on its
training data) and fp32 IR compiled with each setting, timed side by side in interleaved rounds
(``vitflow.infer.bench.timing.time_paths``), every figure a ratio to OpenVINO's defaults measured in the
same rounds (medians of the per-round ratios), with the CPU flags.

    python benchmarks/deployment/openvino_settings.py RUN_OR_CHECKPOINT [--batch-size 16] [--repeats 3] [--json]

Settings: ``default`` (OpenVINO's CPU defaults: latency hint, its own precision choice: bf16 on
AMX / AVX512-BF16 CPUs), ``f32`` (exact float layers), ``bf16``, ``static`` (a static-shape copy per
batch size), ``throughput`` (the throughput hint: a batch split over one stream a core), ``tuned``
(what ``bench infer``'s ``openvino_int8_tuned`` runs: ``vitflow.infer.runtimes.openvino.tuned_settings``).

Smoke run: a tiny digits run (``vitflow train train.total_steps=20 train.run_dir=/tmp/d``), then
``python benchmarks/deployment/openvino_settings.py /tmp/d --repeats 1``.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.infer.bench.paths import Sources
from vitflow.infer.bench.timing import cpu_flags, ratio, time_paths
from vitflow.infer.calibration import calibration_images
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.infer.runtimes.openvino import OpenVinoModel, tuned_settings

SETTINGS = {
    "default": {"precision": "auto"},
    "f32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "static": {"precision": "auto", "static_shapes": True},
    "throughput": {"precision": "auto", "hint": "throughput"},
    "tuned": tuned_settings(),
}


def measure(checkpoint: str, batch_size: int = 16, repeats: int = 3, images: int = 300) -> dict:
    """``{"int8": {setting: {"throughput", "latency"}}, "fp32": {...}, "cpu_flags": [...]}``:
    speed-ups over ``default`` (``> 1``: faster)."""
    state = load_checkpoint(checkpoint)
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    with tempfile.TemporaryDirectory() as tmp:
        sources = Sources(model, info, tmp, lambda: calibration_images(None, info.preprocess, info.classes, state,
                                                                       images))
        runners = {f"{kind} {name}": OpenVinoModel(sources.openvino("vitflow", kind == "int8"), **settings)
                   for kind in ("int8", "fp32") for name, settings in SETTINGS.items()}
        timings = time_paths(runners, info.preprocess.image_size, batch_size, repeats, log=print)
    return {kind: {name: ratio(timings[f"{kind} {name}"], timings[f"{kind} default"]) for name in SETTINGS}
            for kind in ("int8", "fp32")} | {"cpu_flags": cpu_flags(), "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = measure(args.checkpoint, args.batch_size, args.repeats)
    print(f"CPU flags: {' '.join(r['cpu_flags'])}; {r['threads']} threads; speed-ups over OpenVINO's defaults "
          f"(medians of per-round ratios), batch-{args.batch_size} throughput / batch-1 latency")
    for kind in ("int8", "fp32"):
        for name, x in r[kind].items():
            print(f"{kind:5s} {name:11s} throughput x{x['throughput']:.2f}  latency x{x['latency']:.2f}")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
