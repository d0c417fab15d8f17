"""Peak memory of the exact attention backends at long sequences, and what gradient
checkpointing saves on vit_small_patch16_224 (and what it costs in time).

    python benchmarks/models/attention_memory.py [--json] [--quick] [--repeats 3] [--part attention|checkpointing]

Part 1 (attention): one attention call, forward + backward, batch 1, 6 heads of 64 (vit_small's
attention), N = 1025 (32x32 grid + class token) and N = 4097 (64x64 + class token), for the
``math``, ``sdpa`` and ``blockwise`` (block 128) backends, fp32.
Part 2 (checkpointing): vit_small_patch16_224, batch 64, 224 px, fp32, ``attention=math``:
forward + cross-entropy + backward with grad checkpointing ``none``, ``every:2`` and ``all``.

Every cell runs in a fresh Python process, so allocations of one cell cannot hide in another's
peak, and each cell first runs its code once on a small input (batch 1 / N = 65), so that lazily
loaded libraries and thread buffers are not counted. Memory figures:
- ``peak_mib``: on CPU the growth of the process's peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before the measured call) over the resident set before it; on
  CUDA ``torch.cuda.max_memory_allocated`` growth. It includes transient buffers
  (scores, gradients), not only what autograd keeps.
- ``saved_mib``: bytes of the distinct storages autograd saves for the backward (parameters and
  the input excluded) -- the activation memory checkpointing trades away.
Time: median seconds of ``--repeats`` further calls in the same process. With ``--json`` the last
line is ``{"attention": [cells], "checkpointing": [cells]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vitflow.models.attention import AttentionContext, make_kernel  # noqa: E402
from vitflow.models.grad_checkpointing import saved_activation_bytes  # noqa: E402

MIB = 2 ** 20
HEADS, HEAD_DIM = 6, 64


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_growth(fn, device: torch.device) -> int:
    """Bytes the peak memory grows by while running ``fn()`` once (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_bytes("VmRSS")
    fn()
    return _rss_bytes("VmHWM") - before


def timed(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_cell(backend: str, n: int, repeats: int, device: torch.device) -> dict:
    side = int(round((n - 1) ** 0.5))
    kernel = make_kernel(backend, seq_len=n, head_dim=HEAD_DIM, block_size=128).to(device)
    ctx = AttentionContext((side, side), 1)
    warm = torch.randn(1, 65, 3 * HEADS * HEAD_DIM, device=device, requires_grad=True)
    kernel(warm, HEADS, AttentionContext((8, 8), 1)).sum().backward()
    qkv = torch.randn(1, n, 3 * HEADS * HEAD_DIM, device=device, requires_grad=True)
    upstream = torch.randn(1, n, HEADS * HEAD_DIM, device=device)

    def step():
        kernel(qkv, HEADS, ctx).backward(upstream)
        qkv.grad = None

    peak = peak_growth(step, device)
    saved = saved_activation_bytes(lambda: kernel(qkv, HEADS, ctx), exclude=[qkv])
    return {"backend": backend, "tokens": n, "peak_mib": peak / MIB, "saved_mib": saved / MIB,
            "seconds": timed(step, device, repeats)}


def checkpoint_cell(mode: str, batch: int, repeats: int, device: torch.device) -> dict:
    import vitflow

    torch.manual_seed(0)
    model = vitflow.create_model("vit_small_patch16_224", attention="math").to(device)
    model.set_grad_checkpointing(mode)
    torch.nn.functional.cross_entropy(model(torch.randn(1, 3, 224, 224, device=device)),
                                      torch.zeros(1, dtype=torch.long, device=device)).backward()
    model.zero_grad(set_to_none=True)
    x = torch.randn(batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    params = list(model.parameters())

    def loss():
        return torch.nn.functional.cross_entropy(model(x), y)

    def step():
        loss().backward()
        for p in params:
            p.grad = None

    peak = peak_growth(step, device)
    saved = saved_activation_bytes(loss, exclude=params + [x])
    return {"mode": mode, "batch": batch, "peak_mib": peak / MIB, "saved_mib": saved / MIB,
            "seconds": timed(step, device, repeats)}


def run_cell(args: list[str]) -> dict:
    """Runs one cell in a fresh interpreter; returns its JSON result."""
    out = subprocess.run([sys.executable, __file__, "--cell", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="N = 1025 only, checkpointing at batch 8, 1 repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part", choices=["all", "attention", "checkpointing"], default="all")
    p.add_argument("--cell", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cell:
        kind, *rest = args.cell
        if kind == "attention":
            r = attention_cell(rest[0], int(rest[1]), int(rest[2]), device)
        else:
            r = checkpoint_cell(rest[0], int(rest[1]), int(rest[2]), device)
        print(json.dumps(r))
        return

    repeats = 1 if args.quick else args.repeats
    lengths = (1025,) if args.quick else (1025, 4097)
    result = {"device": str(device), "attention": [], "checkpointing": []}
    print(f"attention, fwd+bwd, batch 1, {HEADS} heads x {HEAD_DIM}, fp32, {device}")
    print(f"{'backend':>10} {'tokens':>6} {'peak MiB':>9} {'saved MiB':>9} {'s/call':>7}")
    for n in lengths if args.part != "checkpointing" else ():
        for backend in ("math", "sdpa", "blockwise"):
            r = run_cell(["attention", backend, str(n), str(repeats)])
            result["attention"].append(r)
            print(f"{backend:>10} {n:>6} {r['peak_mib']:>9.1f} {r['saved_mib']:>9.1f} {r['seconds']:>7.3f}")
    batch = 8 if args.quick else 64
    print(f"\nvit_small_patch16_224, batch {batch}, fwd+loss+bwd, fp32, attention=math, {device}")
    print(f"{'checkpoint':>10} {'peak MiB':>9} {'saved MiB':>9} {'s/step':>7} {'time x':>6}")
    for mode in ("none", "every:2", "all") if args.part != "attention" else ():
        r = run_cell(["checkpoint", mode, str(batch), str(repeats)])
        result["checkpointing"].append(r)
        base = result["checkpointing"][0]
        print(f"{mode:>10} {r['peak_mib']:>9.1f} {r['saved_mib']:>9.1f} {r['seconds']:>7.3f} "
              f"{r['seconds'] / base['seconds']:>6.2f}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
