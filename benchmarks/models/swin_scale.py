"""Memory and speed against resolution: Swin-T (windows) vs ViT-S/16 (global attention).

    python benchmarks/models/swin_scale.py [--json] [--quick] [--sizes 224,384,512] [--batch 8] [--dtype fp32|bf16]
                                    [--device cpu|cuda] [--repeats 3] [--window scaled|N]

For each input size and model -- ``swin_tiny_patch4_window7_224`` (the window is ``size // 32``:
7 at 224, 12 at 384, 16 at 512, as timm's 384-px Swin configurations; every stage grid is then a
whole number of windows; ``--window 7`` keeps the 7 x 7 windows at every size, the grids padded to
whole windows) and ``vit_small_patch16_224`` (``img_size=size``; the position embedding
is sized for it) -- one training step (forward, cross-entropy, backward; no optimizer) at
``--batch`` images, ``attention=sdpa``, under ``--dtype`` autocast. Swin's attention cost grows
linearly with the pixels (fixed windows), a ViT's quadratically (all tokens attend to all).

Every cell runs in a fresh Python process after one warm-up step (so lazily loaded libraries do
not count). Figures per cell:
- ``peak_mib``: growth of the peak memory during one step (CPU: the process's ``VmHWM`` after a
  reset through ``/proc/self/clear_refs``; CUDA: ``max_memory_allocated``), see
  ``benchmarks/models/attention_memory.py``;
- ``saved_mib``: bytes autograd keeps for the backward (parameters and input excluded);
- ``images_per_s``: ``--batch`` over the median of ``--repeats`` timed steps.
With ``--json`` the last line is ``{"cells": [{"model", "size", "batch", "dtype", "peak_mib",
"saved_mib", "images_per_s"}, ...]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_memory import MIB, peak_growth, timed  # noqa: E402

MODELS = ("swin_tiny_patch4_window7_224", "vit_small_patch16_224")


def build(name: str, size: int, device: torch.device, window: str = "scaled") -> torch.nn.Module:
    import vitflow

    extra = {"window_size": size // 32 if window == "scaled" else int(window)} if name.startswith("swin") else {}
    return vitflow.create_model(name, img_size=size, attention="sdpa", **extra).to(device).train()


def cell(name: str, size: int, batch: int, dtype: str, device: str, repeats: int, window: str = "scaled") -> dict:
    """One cell, in this process (see the module docstring)."""
    from vitflow.models.grad_checkpointing import saved_activation_bytes

    dev = torch.device(device)
    torch.manual_seed(0)
    model = build(name, size, dev, window)
    x = torch.randn(batch, 3, size, size, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext

    def step() -> None:
        with autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    peak = peak_growth(step, dev)

    def forward() -> torch.Tensor:
        with autocast():
            return model(x)

    saved = saved_activation_bytes(forward, exclude=[*model.parameters(), x])
    seconds = timed(step, dev, repeats)
    return {"model": name, "size": size, "batch": batch, "dtype": dtype, "peak_mib": round(peak / MIB, 1),
            "saved_mib": round(saved / MIB, 1), "images_per_s": round(batch / seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="224,384,512")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", default="scaled", help="Swin's window: scaled (size // 32) or a fixed N (7)")
    ap.add_argument("--quick", action="store_true", help="224 and 384 px, batch 2, one timed step")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # internal: NAME,SIZE run in this process
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cell:
        name, size = args.cell.split(",")
        print(json.dumps(cell(name, int(size), args.batch, args.dtype, args.device, args.repeats, args.window)))
        return
    if args.quick:
        args.sizes, args.batch, args.repeats = "224,384", 2, 1
    print(f"{'model':30s} {'size':>5s} {'batch':>5s} {'dtype':5s} {'peak MiB':>9s} {'saved MiB':>9s} {'img/s':>8s}")
    cells = []
    for size in (int(s) for s in args.sizes.split(",")):
        for name in MODELS:
            cmd = [sys.executable, __file__, "--cell", f"{name},{size}", "--batch", str(args.batch), "--dtype",
                   args.dtype, "--device", args.device, "--repeats", str(args.repeats), "--threads", str(args.threads),
                   "--window", args.window]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(f"{name} at {size}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            c = json.loads(out.stdout.strip().splitlines()[-1])
            c["window"] = args.window if name.startswith("swin") else None
            cells.append(c)
            print(f"{name:30s} {size:5d} {c['batch']:5d} {c['dtype']:5s} {c['peak_mib']:9.1f} {c['saved_mib']:9.1f} "
                  f"{c['images_per_s']:8.2f}", flush=True)
    if args.json:
        print(json.dumps({"cells": cells}))


if __name__ == "__main__":
    main()
