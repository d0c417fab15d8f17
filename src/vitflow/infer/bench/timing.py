"""The timing protocol of ``vitflow bench infer`` and of every side-by-side speed figure vitflow
prints (pruning, token merging, ``vitflow serve --backend auto``, ``bench resolution``).

Every runner is warmed up (compilation happens there), then ``repeats`` rounds run all runners in
turn, so slow drift of a shared machine hits all of them alike; a 0.2 s pause before each runner
lets the previous one's spinning worker threads (OpenMP, ONNX Runtime, OpenVINO) go idle. In each
round a runner makes ``latency_calls`` batch-1 calls (each timed) and batch-``batch_size`` calls
for at least ``min_time`` seconds. Latency: median and 90th percentile over all batch-1 calls
(ms). Throughput: median over rounds of images / second. Ratios between two runners are medians
over the rounds of the per-round ratios. Inputs are random normal tensors (speed does not depend
on pixel values); ``torch.inference_mode`` throughout.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vitflow.timing import sync

IDLE_GAP_S = 0.2  # pause before each path: OpenMP / ONNX Runtime workers spin a while after a call
Runner = Callable[[torch.Tensor], torch.Tensor]
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> list[str]:
    """The instruction-set flags of this CPU that decide the fast path (:data:`CPU_FLAGS` found in
    ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in CPU_FLAGS if f in have]


@dataclass
class Timing:
    """Measurements of one path: every batch-1 call in ms, the median batch-1 call of each round
    in ms, and images/s per round."""

    latencies_ms: list[float] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)
    round_latency_ms: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """``{"latency_ms_p50", "latency_ms_p90", "throughput_ips"}`` (the JSON format)."""
        lat = sorted(self.latencies_ms)
        p90 = lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))]
        return {"latency_ms_p50": round(statistics.median(lat), 3), "latency_ms_p90": round(p90, 3),
                "throughput_ips": round(statistics.median(self.throughputs), 1)}


@torch.inference_mode()
def time_paths(runners: dict[str, Runner], image_size: int | dict[str, int], batch_size: int = 32, repeats: int = 3,
               latency_calls: int = 20, min_time: float = 1.0, log: Callable[[str], None] = print,
               device: torch.device | str = "cpu") -> dict[str, Timing]:
    """Time every runner (see the module docstring for the protocol).

    Args:
        image_size: the input side in pixels, one for all runners or ``{runner: pixels}``.
        device: where the random inputs ``float32 (B, 3, S, S)`` live; on CUDA each timed call
            ends with a synchronisation.
    Returns:
        ``{path: Timing}``.
    """
    sizes = image_size if isinstance(image_size, dict) else dict.fromkeys(runners, image_size)
    inputs = {name: (torch.randn(1, 3, s, s, device=device), torch.randn(batch_size, 3, s, s, device=device))
              for name, s in sizes.items()}
    device = torch.device(device)
    for name, run in runners.items():
        t0 = time.perf_counter()
        x1, xb = inputs[name]
        for x in (x1, x1, xb, xb):
            run(x)
        sync(device)
        log(f"warm-up {name}: {time.perf_counter() - t0:.1f} s")
    timings = {name: Timing() for name in runners}
    for r in range(repeats):
        for name, run in runners.items():
            time.sleep(IDLE_GAP_S)  # let the previous path's spinning worker threads go idle
            t, this_round, (x1, xb) = timings[name], [], inputs[name]
            for _ in range(latency_calls):
                t0 = time.perf_counter()
                run(x1)
                sync(device)
                this_round.append((time.perf_counter() - t0) * 1e3)
            t.latencies_ms += this_round
            t.round_latency_ms.append(statistics.median(this_round))
            n, t0 = 0, time.perf_counter()
            while n < 2 or time.perf_counter() - t0 < min_time:
                run(xb)
                n += 1
            sync(device)
            t.throughputs.append(n * batch_size / (time.perf_counter() - t0))
        log(f"round {r + 1}/{repeats}: " + "  ".join(f"{k} {v.throughputs[-1]:.0f}" for k, v in timings.items()))
    return timings


def speedups(models: dict[str, torch.nn.Module], image_size: int) -> dict:
    """fp32 batch throughput and batch-1 latency of two models (the first the baseline, the second
    the candidate), timed side by side (:func:`time_paths`): ``{"speedup_throughput",
    "speedup_latency", "timing": {name: Timing.summary()}}``."""
    timing = time_paths({k: m.eval() for k, m in models.items()}, image_size, log=lambda s: None)
    before, after = (timing[k].summary() for k in models)
    return {"speedup_throughput": round(after["throughput_ips"] / before["throughput_ips"], 3),
            "speedup_latency": round(before["latency_ms_p50"] / after["latency_ms_p50"], 3),
            "timing": {k: timing[k].summary() for k in models}}


def ratio(a: Timing, b: Timing) -> dict[str, float]:
    """How much faster path ``a`` is than ``b``: medians over the rounds of the per-round
    throughput ratio and batch-1 latency ratio (``> 1``: ``a`` is faster)."""
    return {"throughput": round(statistics.median(x / y for x, y in zip(a.throughputs, b.throughputs)), 3),
            "latency": round(statistics.median(y / x for x, y in zip(a.round_latency_ms, b.round_latency_ms)), 3)}
