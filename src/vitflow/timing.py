"""Timing candidate implementations against each other, for the choices made at run time
(``attention=auto``, ``cpu_bf16_matmul=auto``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch


def tracing() -> bool:
    """Inside torch.compile / torch.export / TorchScript tracing (no timing runs, no data-dependent
    Python there)."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch >= 2.5
    return torch.compiler.is_compiling() or exporting() or torch.jit.is_tracing()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(calls: dict[str, Callable[[], object]], rounds: int, device: torch.device = torch.device("cpu"),
            errors: tuple[type[BaseException], ...] = (),
            on_error: Callable[[str, BaseException], None] | None = None) -> dict[str, float]:
    """Each call's fastest time in seconds: one warm-up round, then ``rounds`` timed rounds, the
    order rotating from round to round so that no candidate always runs first. A call that raises
    one of ``errors`` is reported to ``on_error``, not called again, and gets ``inf``; other
    exceptions propagate."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: set[str] = set()
    for r in range(rounds + 1):  # round 0 warms up
        for n in names[r % len(names):] + names[:r % len(names)]:
            if n in failed:
                continue
            sync(device)
            t0 = time.perf_counter()
            try:
                calls[n]()
                sync(device)
            except errors as e:
                if on_error is not None:
                    on_error(n, e)
                failed.add(n)
                continue
            if r:
                times[n].append(time.perf_counter() - t0)
    return {n: float("inf") if n in failed else min(times[n]) for n in names}


SPREAD_LIMIT = 0.2  # rounds of one measurement further apart than this (relative to their median): a busy machine


def spread(values: Sequence[float]) -> float:
    """How far apart repeated measurements are: ``(max - min) / median`` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("inf")


def busy_warning(measured: dict[str, Sequence[float]], limit: float = SPREAD_LIMIT) -> str | None:
    """A warning naming the measurements (name -> rounds) whose rounds spread more than ``limit``,
    or ``None``: their figures are unreliable, the machine was busy."""
    wide = {k: spread(v) for k, v in measured.items() if spread(v) > limit}
    if not wide:
        return None
    return ("the machine looks busy: rounds of " + ", ".join(f"{k} spread {s:.0%}" for k, s in wide.items())
            + f" (over {limit:.0%}); these figures are unreliable, measure again on an idle machine")
