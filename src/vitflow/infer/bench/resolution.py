"""``vitflow bench resolution``: a checkpoint's accuracy, speed and memory against its input size.

At each size ``S`` (pixels, square) the checkpoint's model is rebuilt for ``S`` and its weights are
fitted exactly as fine-tuning at ``model.img_size=S`` fits them
(:func:`vitflow.checkpoint.model_from_checkpoint` with ``img_size``, which loads through
:func:`vitflow.models.pretrained.weights.load_adapted`): a learned position embedding and relative
position tables are resampled bicubically (and logged), Swin's window tables follow the windows of
the new grid, fixed sine-cosine positions and RoPE are computed for the grid. Nothing is trained
at ``S``: the row is what the weights give there. The model is then

- scored on the split ``vitflow eval`` scores (the test split, else the validation split; the
  same ``key=value`` overrides) with the checkpoint's preprocessing at ``S`` (resize to
  ``S / crop_pct``, center crop ``S``, its mean and std): top-1, top-5, loss. At the
  checkpoint's own size this is ``vitflow eval`` (tested);
- timed on random ``float32 (B, 3, S, S)`` inputs under the run's precision
  (:func:`vitflow.infer.bench.timing.time_paths`: all sizes in turn in each of ``repeats`` rounds, medians;
  images/s at batch ``B``, batch-1 latency);
- measured for peak memory: the bytes of tensors held during one batch-``B`` forward (weights and
  buffers, the input, and the largest set of intermediate tensors alive at once: on CUDA from
  ``torch.cuda.max_memory_allocated``, on the CPU from the allocation events of
  ``torch.profiler`` with ``profile_memory``).

A size the family cannot take (not a multiple of the patch size) is skipped with one line giving
the model's own reason; when no size fits, ValueError.

Why measure it: a model trained with random-resized crops sees objects larger than a center crop
at the same size shows them, so it often scores better tested a little *above* its training
size, and fine-tuning briefly at the test size closes the rest of the gap (FixRes: Touvron et
al. 2019, "Fixing the train-test resolution discrepancy"); the cost grows with the token count,
about ``(S / S0)^2`` for a plain ViT and more where attention's quadratic term matters.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from vitflow.infer.bench.timing import time_paths
from vitflow.infer.evaluate import EvalSetup, eval_setup, score
from vitflow.models import model_kwargs
from vitflow.models.kernels import onednn
from vitflow.timing import busy_warning, sync

log = logging.getLogger(__name__)

LATENCY_CALLS = 5  # batch-1 calls per size and round
DEFAULT_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5)  # of the trained size, when no sizes are given


def default_sizes(trained: int, patch: int) -> list[int]:
    """``DEFAULT_SCALES`` times the trained size, each rounded to a multiple of the patch size."""
    return sorted({max(patch, round(trained * f / patch) * patch) for f in DEFAULT_SCALES})


def inference_peak_bytes(run: Callable[[torch.Tensor], object], x: torch.Tensor, model: torch.nn.Module) -> int | None:
    """Bytes of tensors held at the peak of ``run(x)``: the model's parameters and buffers, the
    input ``x``, and the most bytes of intermediate tensors alive at one time during the call
    (CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before; CPU: the running
    sum of ``torch.profiler``'s allocation events, ``profile_memory=True``). ``None`` when the
    profiler gives no allocation events."""
    fixed = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    fixed += x.numel() * x.element_size()
    if x.device.type == "cuda":
        sync(x.device)
        base = torch.cuda.memory_allocated(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        run(x)
        sync(x.device)
        return fixed + max(0, torch.cuda.max_memory_allocated(x.device) - base)
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler prints its stages to stderr
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(x)
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        return None
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    return fixed + max(0, max(itertools.accumulate(n for _, n in events), default=0))


def _runner(model: torch.nn.Module, setup: EvalSetup) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with setup.precision.autocast():
            return model(x)
    return run


def _models(setup: EvalSetup, sizes: Sequence[int], weights: str, say: Callable[[str], None]
            ) -> tuple[dict[int, torch.nn.Module], list[dict]]:
    """The model at each size it takes, and ``{"size", "reason"}`` for each it does not."""
    models, skipped = {}, []
    for s in sizes:
        try:
            models[s] = setup.model(weights, s)
        except ValueError as e:
            skipped.append({"size": s, "reason": str(e)})
            say(f"size {s}: skipped: {e}")
    return models, skipped


def bench_resolution(checkpoint, sizes: Sequence[int] | None = None, overrides: Sequence[str] = (),
                     weights: str = "auto", batch_size: int = 32, repeats: int = 3, min_time: float = 1.0,
                     device: str | None = None, say: Callable[[str], None] = print) -> dict:
    """Accuracy, images/s and peak memory of a checkpoint at each input size (see the module text).

    Args:
        checkpoint: a checkpoint file or run directory (its newest checkpoint).
        sizes: input sizes in pixels (default :func:`default_sizes` of the trained size).
        overrides: ``key=value`` config overrides, as for ``vitflow eval`` (``data.path=...``,
            ``data.test_split=test[:2000]``, ``train.precision=fp32``).
        weights: ``auto`` (EMA when saved), ``ema`` or ``raw``.
        batch_size: images per timed forward pass and in the memory measurement.
        repeats / min_time: timing rounds, and seconds of batch calls per size in each.
        say: where progress and skip lines go.
    Returns:
        ``{"checkpoint", "step", "model", "trained_size", "split", "split_expr", "weights",
        "device", "precision", "threads", "batch_size", "rows", "skipped"}``; each row
        ``{"size", "top1", "top5", "loss", "images", "images_per_s" (batch_size, model only),
        "latency_ms_p50", "latency_ms_p90" (batch 1, ms), "peak_memory_mib" (MiB, or None),
        "eval_images_per_s" (the scoring pass, decoding included)}``, sorted by size; each skip
        ``{"size", "reason"}``.
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, a multi-label checkpoint (top-1 is
        what this measures), sizes <= 0, or no size the model takes; ConfigError; DataError.
    """
    setup = eval_setup(checkpoint, overrides, device)
    if setup.task != "multiclass":
        raise ValueError(f"vitflow bench resolution scores top-1: {setup.state['path']} is a {setup.task} checkpoint")
    args = {k: v for k, v in setup.state["model_args"].items() if k != "lora"}
    kw = model_kwargs(**args)
    trained = setup.preprocess.image_size
    sizes = sorted(set(sizes or default_sizes(trained, int(kw.get("patch_size", 16)))))
    if sizes[0] <= 0:
        raise ValueError(f"--sizes: every size must be > 0 pixels (got {sizes[0]})")
    models, skipped = _models(setup, sizes, weights, say)
    if not models:
        raise ValueError(f"{args['name']} takes none of the sizes {sizes}: " + "; ".join(
            f"{s['size']}: {s['reason']}" for s in skipped))
    rows = {s: _scored(setup, models[s], s, say) for s in models}
    runners = {f"{s}px": _runner(m, setup) for s, m in models.items()}
    with onednn.run_gemm(setup.state.get("fp32_gemm")):  # the GEMM the scoring pass ran on
        timings = time_paths(runners, {f"{s}px": s for s in models}, batch_size, repeats, LATENCY_CALLS, min_time,
                             log=lambda m: log.info("%s", m), device=setup.device)
        with torch.inference_mode():
            for s, m in models.items():
                x = torch.randn(batch_size, 3, s, s, device=setup.device)
                peak = inference_peak_bytes(runners[f"{s}px"], x, m)
                rows[s].update({**_timing_row(timings[f"{s}px"].summary()),
                                "peak_memory_mib": None if peak is None else round(peak / 2**20, 1)})
    if warning := busy_warning({k: t.throughputs for k, t in timings.items()}):
        say(f"warning: {warning}")
    state = setup.state
    return {"checkpoint": state["path"], "step": state["step"], "model": args["name"], "trained_size": trained,
            "split": setup.role, "split_expr": setup.split,
            "weights": "ema" if state.get("ema") and weights != "raw" else "raw", "device": str(setup.device),
            "precision": setup.precision.name, "threads": torch.get_num_threads(), "batch_size": batch_size,
            "rows": [rows[s] for s in sorted(rows)], "skipped": skipped}


def _scored(setup: EvalSetup, model: torch.nn.Module, size: int, say: Callable[[str], None]) -> dict:
    """One size's accuracy row: the split scored at ``size`` px with the checkpoint's preprocessing."""
    t0 = time.perf_counter()
    result = score(setup, model, replace(setup.preprocess, image_size=size))
    seconds = max(time.perf_counter() - t0, 1e-9)
    say(f"size {size}: top-1 {result['top1']:.2%} on {result['images']} images ({seconds:.1f} s)")
    return {"size": size, "top1": result["top1"], "top5": result["top5"], "loss": result["loss"],
            "images": result["images"], "eval_images_per_s": round(result["images"] / seconds, 1)}


def _timing_row(summary: dict[str, float]) -> dict[str, float]:
    return {"images_per_s": summary["throughput_ips"], "latency_ms_p50": summary["latency_ms_p50"],
            "latency_ms_p90": summary["latency_ms_p90"]}


def format_table(result: dict) -> str:
    """The text table of one :func:`bench_resolution` result: a row per size (top-1 and its change
    from the trained size's row, loss, images/s and its ratio to the trained size's, batch-1
    latency, peak memory), then a line per skipped size."""
    rows = result["rows"]
    base = next((r for r in rows if r["size"] == result["trained_size"]), None)
    lines = [f"{'size':>5s} {'top-1':>7s} {'vs own':>7s} {'loss':>7s} {'img/s':>9s} {'x own':>6s} "
             f"{'b1 ms':>7s} {'peak MiB':>9s}"]
    for r in rows:
        d_top1 = f"{(r['top1'] - base['top1']) * 100:+.2f}" if base else "-"
        x_ips = f"{r['images_per_s'] / base['images_per_s']:.2f}" if base else "-"
        mem = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f}"
        own = "  <- trained size" if r["size"] == result["trained_size"] else ""
        lines.append(f"{r['size']:5d} {r['top1'] * 100:6.2f}% {d_top1:>7s} {r['loss']:7.4f} "
                     f"{r['images_per_s']:9.1f} {x_ips:>6s} {r['latency_ms_p50']:7.2f} {mem:>9s}{own}")
    lines += [f"{s['size']:5d} skipped: {s['reason']}" for s in result["skipped"]]
    return "\n".join(lines)
