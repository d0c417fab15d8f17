"""``auto``: time the exact backends on the real shape, device and dtype; keep the fastest.

The best kernel depends on the machine, the dtype and the sequence length: on the project's CPU
explicit attention trains a 65-token ViT ~2x faster than fused SDPA in bf16 while SDPA wins by
1.2-4x at 1025 tokens (``shared/reference/cpu-baselines.md``). So the first call with a new
``(qkv shape, heads, dtype, device, training?, bias?)`` runs each candidate on random data of
that shape (forward, plus backward when gradients are needed; 1 warm-up and 3 timed calls,
median), keeps the fastest for every later call with that key, and logs the choice. Choices are
shared by all layers and models in the process. The RNG state is left untouched.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from vitflow.models.attention.core import AttentionContext, AttentionKernel

log = logging.getLogger(__name__)

_CHOICES: dict[tuple, str] = {}
TIMED_CALLS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            _sync(x.device)
            t0 = time.perf_counter()
            out = kernel(x, num_heads, tctx)
            if backward:
                out.backward(torch.ones_like(out))
                x.grad = None
            _sync(x.device)
            if i:
                times.append(time.perf_counter() - t0)
            del out
    except (RuntimeError, ValueError) as e:  # out of memory, unsupported option
        log.debug("attention=auto: %s failed: %s", type(kernel).__name__, e)
        return float("inf")
    return statistics.median(times)


class AutoKernel(AttentionKernel):
    """Picks the fastest of ``candidates`` (name -> kernel) per input key (see module docstring)."""

    def __init__(self, candidates: dict[str, AttentionKernel]):
        super().__init__()
        self.candidates = torch.nn.ModuleDict(candidates)
        self.choice: str | None = None  # the latest pick, for reports

    def _key(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext, backward: bool) -> tuple:
        bias = None if ctx.bias is None else (tuple(ctx.bias.shape), ctx.bias.requires_grad)
        return (tuple(qkv.shape), num_heads, qkv.dtype, str(qkv.device), backward, bias, ctx.dropout_p > 0,
                torch.is_autocast_enabled(qkv.device.type), tuple(self.candidates))

    def choose(self, qkv: torch.Tensor, num_heads: int, ctx: AttentionContext) -> str:
        """The candidate name for this input (timing the candidates on first sight of its key)."""
        backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, ctx.bias))
        key = self._key(qkv, num_heads, ctx, backward)
        if key not in _CHOICES:
            devices = [qkv.device] if qkv.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad() if not backward else torch.enable_grad():
                times = {name: time_kernel(k, qkv, num_heads, ctx, backward)
                         for name, k in self.candidates.items()}
            best = min(times, key=times.get)
            if times[best] == float("inf"):
                raise RuntimeError(f"attention=auto: no candidate ran on qkv {tuple(qkv.shape)}")
            _CHOICES[key] = best
            log.info("attention=auto: %s for qkv %s %s on %s, %s (ms: %s)", best, tuple(qkv.shape),
                     str(qkv.dtype).removeprefix("torch."), qkv.device, "fwd+bwd" if backward else "fwd",
                     ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items()))
        return _CHOICES[key]

    def forward(self, qkv, num_heads, ctx):
        self.choice = self.choose(qkv, num_heads, ctx)
        return self.candidates[self.choice](qkv, num_heads, ctx)


def clear_choices() -> None:
    """Forget every timed choice (the next call of each key times the candidates again)."""
    _CHOICES.clear()
