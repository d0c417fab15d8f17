"""How long until the first training step: DINOv2-S/14 (``vit_small_patch14_reg4_dinov2``, random
weights) in bf16 on the CPU, vitflow's first run on a machine (its choices made by timing:
``attention=auto``, ``cpu_bf16_matmul=auto``, the fp32 GEMM), its second run (the same choices from
the machine's cache, ``vitflow.timing``), timm eager and timm + ``torch.compile``.

    python benchmarks/training/warmup.py [--rounds 3] [--img-size 224] [--batch-size 8] [--json]

Each measurement is a fresh process (the choices and compiled graphs live per process): it imports
torch and the library, builds the model, then times from there to the end of its first training
step (forward under bf16 autocast, backward, AdamW step) on a random batch; the import time is
reported apart. The four kinds alternate within each round (cold vitflow, warm vitflow, timm, timm
compiled), and each round's cold run starts from an empty cache; medians over the rounds. Prints
the CPU flags; the figures move with the machine's load (side-by-side ratios are the robust part).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = "vit_small_patch14_reg4_dinov2"
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
kind, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind.startswith("timm"):
    import timm
    model = timm.create_model("%s", pretrained=False, img_size=size, num_classes=10)
else:
    import vitflow
    model = vitflow.create_model("%s", img_size=size, num_classes=10, attention="auto", cpu_bf16_matmul="auto")
imported = time.perf_counter() - t0
net = torch.compile(model) if kind == "timm_compile" else model
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
t1 = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = torch.nn.functional.cross_entropy(net(x), y)
loss.backward()
opt.step()
first = time.perf_counter() - t1
t2 = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = torch.nn.functional.cross_entropy(net(x), y)
loss.backward()
opt.step()
print(json.dumps({"import_and_build_s": imported, "first_step_s": first, "second_step_s": time.perf_counter() - t2}))
""" % (MODEL, MODEL)


def measure(kind: str, size: int, batch: int, cache: Path) -> dict:
    env = {**os.environ, "VITFLOW_CHOICES_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(size), str(batch)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    flags = subprocess.run("grep -o 'amx[a-z0-9_]*\\|avx512_bf16\\|avx2' /proc/cpuinfo | sort -u", shell=True,
                           capture_output=True, text=True).stdout.split()
    print(f"CPU flags: {' '.join(flags)}; {os.cpu_count()} cores; {MODEL} bf16, {args.img_size} px, batch "
          f"{args.batch_size}", flush=True)
    kinds = ("vitflow_first_run", "vitflow_second_run", "timm", "timm_compile")
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "choices.json"  # empty: the first run times, the second takes its choices
            for kind in kinds:
                m = measure("vitflow" if kind.startswith("vitflow") else kind, args.img_size, args.batch_size, cache)
                got[kind].append(m)
                print(f"round {r}: {kind:20s} first step {m['first_step_s']:6.1f} s (then {m['second_step_s']:.2f} "
                      f"s a step; imports and model {m['import_and_build_s']:.1f} s)", flush=True)
    med = {k: {f: statistics.median(m[f] for m in v) for f in v[0]} for k, v in got.items()}
    for k, v in med.items():
        print(f"median {k:20s} first step {v['first_step_s']:6.1f} s, import+build {v['import_and_build_s']:.1f} s, "
              f"to first step end {v['first_step_s'] + v['import_and_build_s']:.1f} s "
              f"({v['first_step_s'] - med['timm']['first_step_s']:+.1f} s against timm's first step)")
    if args.json:
        print(json.dumps({"cpu_flags": flags, "img_size": args.img_size, "batch_size": args.batch_size,
                          "median": {k: {f: round(x, 2) for f, x in v.items()} for k, v in med.items()}}))


if __name__ == "__main__":
    main()
