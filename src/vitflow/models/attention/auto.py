"""``auto``: time the exact backends on the real shape, device and dtype; keep the fastest.

The best kernel depends on the machine, the dtype and the sequence length: on the project's CPU
explicit attention trains a 65-token ViT ~2x faster than fused SDPA in bf16 while SDPA wins by
1.2-4x at 1025 tokens (``shared/reference/cpu-baselines.md``). A choice is made once per key
``(qkv shape, heads, dtype, device, bias?, dropout?, autocast?, training?)`` and logged; choices
are shared by all layers and models in the process, and the RNG state is left untouched. They are
part of :mod:`vitflow.timing`'s record: kept in training checkpoints (a resumed run takes them
back), cached per machine (a new run takes an earlier one's) and, under torchrun, rank 0's.

- In a model (:func:`tune`, called by ``VisionTransformer``): the whole block stack runs on the
  real tokens with each candidate forced in every block (forward, plus the backward to the
  input and the blocks' parameters when training; one warm-up run each, then
  :data:`TUNE_ROUNDS` rounds in rotating order, the fastest run kept; within :data:`TIE` of
  the fastest, the earlier candidate — sdpa, math, blockwise — wins, so that timing noise does
  not pick the memory-saving blockwise kernel for speed). Only the whole stack
  shows what a backend costs: measured here, a vit_small fp32 training step with ``math`` ran at
  0.79x ``sdpa`` end to end although a single block (or the kernel alone) timed ``math`` faster —
  twelve blocks' saved N x N probabilities are what costs.
- A kernel called on its own (:meth:`AutoKernel.choose`): each candidate runs on random data of
  the qkv shape (1 warm-up and 3 timed calls, median).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import statistics
import time
from typing import Callable, Iterator, Sequence

import torch

from vitflow import timing
from vitflow.models.attention.core import AttentionContext, AttentionKernel
from vitflow.timing import fastest, sync

log = logging.getLogger(__name__)

KIND = "attention"  # its choices in vitflow.timing's record: kept in checkpoints, cached per machine
_CHOICES: dict[tuple, str] = timing.choice_table(KIND)
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("vitflow_auto_forced", default=None)
TIMED_CALLS = 3
TUNE_ROUNDS = 3
TIE = 0.03  # candidates within 3% of the fastest count as tied: the first in candidate order wins


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """Every :class:`AutoKernel` with a candidate ``name`` runs it inside the block (no timing)."""
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def decided(key: tuple) -> bool:
    """True when ``key`` (:meth:`AutoKernel.key`) already has a choice: this process's, a resumed
    run's or the machine's cache's (:mod:`vitflow.timing`), which it then takes."""
    if key in _CHOICES:
        return True
    known = timing.remembered(KIND, key)
    if known is not None:
        timing.record(KIND, key, known, timed=False)
    return known is not None


def tune(keys: Sequence[tuple], names: Sequence[str], run: Callable[[], object], device: torch.device,
         what: str = "block stack") -> str:
    """Choose among ``names`` for every key in ``keys`` by timing ``run`` (one call of the
    enclosing computation, e.g. a model's blocks forward and backward) with each candidate
    :func:`forced`: one warm-up call each, then :data:`TUNE_ROUNDS` rounds in rotating order; the
    fastest call counts. A candidate that raises ``RuntimeError`` / ``ValueError`` (out of memory,
    unsupported) is dropped. Records and logs the choice and returns it; the RNG state is left
    untouched.

    Raises:
        RuntimeError: no candidate ran.
    """
    def call(name: str) -> Callable[[], None]:
        def forced_run() -> None:
            with forced(name):
                run()
        return forced_run

    def failed(name: str, e: BaseException) -> None:
        log.warning("attention=auto: candidate %s failed, left out: %s", name, e)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        best = fastest({n: call(n) for n in names}, TUNE_ROUNDS, device, (RuntimeError, ValueError), failed)
    for key in sorted(keys, key=str):  # the same order on every rank (each agrees with rank 0)
        choice = _record(key, best, what)
    return choice


def _record(key: tuple, times: dict[str, float], what: str) -> str:
    quickest = min(times.values())
    if quickest == float("inf"):
        raise RuntimeError(f"attention=auto: no candidate ran on qkv {key[0]}")
    best = timing.record(KIND, key, next(n for n, t in times.items() if t <= quickest * (1 + TIE)))
    log.info("attention=auto: %s for qkv %s %s on %s, %s (%s ms: %s)", best, key[0], str(key[2]).removeprefix("torch."),
             key[3], "fwd+bwd" if key[-1] else "fwd", what, ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items()))
    return best


def time_kernel(kernel: AttentionKernel, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext,
                backward: bool, calls: int = TIMED_CALLS) -> float:
    """Median seconds of ``calls`` calls of ``kernel`` on random data shaped like ``qkv`` (after
    one warm-up call), forward and, if ``backward``, backward. ``inf`` if the kernel fails
    (e.g. out of memory)."""
    x = torch.randn(qkv.shape, dtype=qkv.dtype, device=qkv.device, requires_grad=backward)
    bias = ctx.bias
    if bias is not None:
        bias = bias.detach().clone().requires_grad_(backward and ctx.bias.requires_grad)
    tctx = AttentionContext(ctx.grid, ctx.num_prefix_tokens, bias, ctx.dropout_p)
    times = []
    try:
        for i in range(calls + 1):
            sync(x.device)
            t0 = time.perf_counter()
            out = kernel(x, num_heads, tctx)
            if backward:
                out.backward(torch.ones_like(out))
                x.grad = None
            sync(x.device)
            if i:
                times.append(time.perf_counter() - t0)
            del out
    except (RuntimeError, ValueError) as e:  # out of memory, unsupported option
        log.warning("attention=auto: candidate %s failed, left out: %s", type(kernel).__name__, e)
        return float("inf")
    return statistics.median(times)


class AutoKernel(AttentionKernel):
    """Picks the fastest of ``candidates`` (name -> kernel) per input key (see module docstring)."""

    def __init__(self, candidates: dict[str, AttentionKernel]):
        super().__init__()
        self.candidates = torch.nn.ModuleDict(candidates)
        self.choice: str | None = None  # the latest pick, for reports

    def key(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> tuple:
        """The choice key of a call on ``qkv`` (its last entry: whether a backward will follow)."""
        bias = None if ctx.bias is None else (tuple(ctx.bias.shape), ctx.bias.requires_grad)
        backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, ctx.bias))
        return (tuple(qkv.shape), num_heads, qkv.dtype, str(qkv.device), bias, ctx.dropout_p > 0,
                torch.is_autocast_enabled(qkv.device.type), tuple(self.candidates), backward)

    def choose(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> str:
        """The candidate name for this input (timing the candidates alone, on random data, on
        first sight of its key unless :func:`tune` already chose)."""
        key = self.key(qkv, num_heads, ctx)
        backward = key[-1]
        if not decided(key):
            devices = [qkv.device] if qkv.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad() if not backward else torch.enable_grad():
                times = {name: time_kernel(k, qkv, num_heads, ctx, backward)
                         for name, k in self.candidates.items()}
            _record(key, times, "kernel alone")
        return _CHOICES[key]

    def forward(self, qkv, num_heads, ctx):
        name = _FORCED.get()
        if name in self.candidates:
            return self.candidates[name](qkv, num_heads, ctx)
        self.choice = self.choose(qkv, num_heads, ctx)
        return self.candidates[self.choice](qkv, num_heads, ctx)


def clear_choices() -> None:
    """Forget every timed choice, a resumed run's too (the next call of each key takes the machine's
    cache's or times the candidates again)."""
    timing.forget(KIND)
