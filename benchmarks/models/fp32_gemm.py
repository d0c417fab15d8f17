"""fp32 training and inference of vitflow models with the linear layers on oneDNN's GEMM against
PyTorch's (``vitflow.models.kernels.onednn``), side by side in one process.

    python benchmarks/models/fp32_gemm.py [--models cifar,tiny,swin,siglip] [--rounds 5] [--steps 4] [--json]

For each model (vitflow's ``vit_cifar_patch4_32`` at batch 64, ``vit_tiny_patch16_224`` at 32,
``swin_tiny_patch4_window7_224`` at 32, ``vit_base_patch16_siglip_224`` at 16; random weights,
synthetic inputs, ``attention=math``) it times ``--steps`` training steps (forward, cross-entropy,
backward, fused AdamW step, ``zero_grad``) and ``--steps`` inference batches (``inference_mode``)
with ``onednn.forced("onednn")`` and ``forced("torch")``, in ``--rounds`` rounds whose order
alternates, one warm-up step each time. It prints images/s (median over rounds) of each GEMM and
the ratio oneDNN/torch, of the medians and as the median of each round's own ratio (a round's two
runs are back to back, so a slow spell of a shared machine weighs on both). With ``--json`` the last
line is ``{"fp32_gemm_auto": "onednn"|"torch", "cells": [{"model", "mode", "onednn_ips",
"torch_ips", "ratio", "paired_ratio"}, ...]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import vitflow  # noqa: E402
from vitflow.models import MODELS as MODEL_CONFIGS  # noqa: E402
from vitflow.models.kernels import onednn

MODELS = {"cifar": ("vit_cifar_patch4_32", 64), "tiny": ("vit_tiny_patch16_224", 32),
          "swin": ("swin_tiny_patch4_window7_224", 32), "siglip": ("vit_base_patch16_siglip_224", 16)}
GEMMS = ("onednn", "torch")


def images_per_second(model: torch.nn.Module, x: torch.Tensor, mode: str, steps: int) -> float:
    """Images/s of ``steps`` training steps or inference batches after one warm-up."""
    y = torch.zeros(x.shape[0], dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if mode == "train" else None

    def step() -> None:
        if opt is None:
            with torch.inference_mode():
                model(x)
            return
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model.train(mode == "train")
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * x.shape[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cifar,tiny,swin,siglip")
    ap.add_argument("--modes", default="train,infer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    auto = onednn.fp32_gemm()
    print(f"fp32 GEMM auto choice on this CPU: {auto}; {torch.get_num_threads()} threads")
    print(f"{'model':30s} {'mode':5s} {'oneDNN img/s':>13s} {'torch img/s':>12s} {'ratio':>6s} {'paired':>7s}")
    cells = []
    for key in args.models.split(","):
        name, batch = MODELS[key]
        model = vitflow.create_model(name, num_classes=10, attention="math")
        size = MODEL_CONFIGS[name]["img_size"]
        x = torch.randn(batch, 3, size, size)
        for mode in args.modes.split(","):
            rates: dict[str, list[float]] = {g: [] for g in GEMMS}
            for r in range(args.rounds):
                for gemm in GEMMS[r % 2:] + GEMMS[:r % 2]:
                    with onednn.forced(gemm):
                        rates[gemm].append(images_per_second(model, x, mode, args.steps))
            med = {g: statistics.median(v) for g, v in rates.items()}
            paired = statistics.median(a / b for a, b in zip(rates["onednn"], rates["torch"]))
            print(f"{name:30s} {mode:5s} {med['onednn']:13.1f} {med['torch']:12.1f} "
                  f"{med['onednn'] / med['torch']:6.2f} {paired:7.2f}", flush=True)
            cells.append({"model": name, "mode": mode, "onednn_ips": round(med["onednn"], 2),
                          "torch_ips": round(med["torch"], 2), "ratio": round(med["onednn"] / med["torch"], 3),
                          "paired_ratio": round(paired, 3)})
    if args.json:
        print(json.dumps({"fp32_gemm_auto": auto, "cells": cells}))


if __name__ == "__main__":
    main()
