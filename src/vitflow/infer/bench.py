"""``vitflow bench infer``: inference speed of one checkpoint along every deployment path, side
by side with timm's model of the same configuration and weights (:func:`timm_model`: the
same-name model for the pretrained families, ``VisionTransformer`` for the ViT family,
``MultiScaleVit`` of the same configuration for MViTv2), in one process.

Paths (the keys of the JSON result):

=====================  ==========================================================================
``timm_eager_fp32``    timm's model (SDPA attention), fp32, eager: the baseline
``timm_eager_bf16``    the same with its weights cast to bf16 (``model.bfloat16()``; faster than
                       autocast for timm inference on the reference CPU)
``eager_fp32``         the vitflow model as trained (its attention backend), fp32
``eager_bf16``         the vitflow model with bf16 weights (what ``predict --precision bf16`` runs)
``compiled``           ``torch.compile`` (inductor) of the ``eager_bf16`` model where the CPU has
                       native bf16, else of ``eager_fp32``
``onnxruntime_fp32``   the ONNX export with the CPU graph fusions (``export --optimize``)
``onnxruntime_int8``   that graph with dynamic INT8 weights (``vitflow quantize``)
=====================  ==========================================================================

Protocol: every path is warmed up (compilation happens there), then ``repeats`` rounds run
all paths in turn, so slow drift of a shared machine hits all of them alike; a 0.2 s pause
before each path lets the previous one's spinning worker threads (OpenMP, ONNX Runtime) go idle. In each round a
path makes ``latency_calls`` batch-1 calls (each timed) and batch-``batch_size`` calls for at
least ``min_time`` seconds. Latency: median and 90th percentile over all batch-1 calls (ms).
Throughput: median over rounds of images / second. Inputs are random normal tensors (speed
does not depend on pixel values); ``torch.inference_mode`` throughout.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.infer.export import export_onnx, optimize_onnx
from vitflow.infer.hub_folder import timm_model_args
from vitflow.infer.onnx_model import ModelInfo, OnnxModel
from vitflow.infer.quantize import quantize_onnx
from vitflow.models import family_of, model_kwargs
from vitflow.runtime import cpu_bf16_supported
from vitflow.timing import busy_warning

PATHS = ("timm_eager_fp32", "timm_eager_bf16", "eager_fp32", "eager_bf16", "compiled", "onnxruntime_fp32",
         "onnxruntime_int8")
BASELINE = "timm_eager_fp32"
IDLE_GAP_S = 0.2  # pause before each path: OpenMP / ONNX Runtime workers spin a while after a call
Runner = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Timing:
    """Measurements of one path: every batch-1 call in ms, and images/s per round."""

    latencies_ms: list[float] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """``{"latency_ms_p50", "latency_ms_p90", "throughput_ips"}`` (the JSON format)."""
        lat = sorted(self.latencies_ms)
        p90 = lat[min(len(lat) - 1, int(round(0.9 * (len(lat) - 1))))]
        return {"latency_ms_p50": round(statistics.median(lat), 3), "latency_ms_p90": round(p90, 3),
                "throughput_ips": round(statistics.median(self.throughputs), 1)}


def timm_model(model_args: dict) -> torch.nn.Module:
    """timm's model of the same configuration as a vitflow ``model_args`` (eval mode, timm's
    initialisation): for the families registered under timm's names (DeiT III, DINOv2, CLIP,
    SigLIP, BEiT, EVA-02, DINOv3) ``timm.create_model(name, pretrained=False, img_size=...,
    num_classes=..., <sizes that differ>)`` (:func:`vitflow.infer.hub_folder.timm_model_args`); for
    the ViT family timm's ``VisionTransformer`` from the basic arguments (pruning ignored: the
    unpruned configuration).

    Raises:
        ValueError: timm is not installed or has no model of that name; an option timm's model
            lacks (named).
    """
    try:
        import timm
        from timm.models.vision_transformer import VisionTransformer as TimmViT
    except ImportError:
        raise ValueError("vitflow bench infer compares against timm: pip install timm") from None

    if family_of(model_args["name"]).name == "mvit":
        return _timm_mvit(model_args)
    if family_of(model_args["name"]).name != "vit":
        name, targs = timm_model_args(model_args)
        if not timm.is_model(name):
            raise ValueError(f"timm {timm.__version__} has no model {name!r} to compare with: upgrade timm")
        return timm.create_model(name, pretrained=False, **targs).eval()
    args = {k: v for k, v in model_args.items() if k not in ("block_heads", "block_mlp_hidden", "lora")}
    kw = model_kwargs(args.pop("name"), **args)
    avg = kw.get("global_pool", "token") == "avg"
    return TimmViT(img_size=kw["img_size"], patch_size=kw["patch_size"], num_classes=kw.get("num_classes", 1000),
                   embed_dim=kw["embed_dim"], depth=kw["depth"], num_heads=kw["num_heads"],
                   mlp_ratio=kw.get("mlp_ratio", 4.0), global_pool="avg" if avg else "token",
                   class_token=not avg).eval()


def _timm_mvit(model_args: dict) -> torch.nn.Module:
    """timm's ``MultiScaleVit`` of an MViTv2 ``model_args``, built from its configuration
    (:func:`vitflow.models.mvit.variants.timm_config`): for a variant timm names (``mvitv2_tiny``)
    the model ``timm.create_model`` builds, for vitflow's own (``mvitv2_cifar_32``) the same class."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    from vitflow.models.mvit.variants import timm_config

    args = {k: v for k, v in model_args.items() if k != "lora"}
    cfg, kw = timm_config(model_kwargs(args.pop("name"), **args))
    return MultiScaleVit(MultiScaleVitCfg(**cfg), **kw).eval()


def _bf16(model: torch.nn.Module) -> Runner:
    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    return lambda x: m(x.to(torch.bfloat16))


def build_paths(model: torch.nn.Module, info: ModelInfo, workdir: str | Path,
                paths: tuple[str, ...] = PATHS) -> tuple[dict[str, Runner], dict[str, str]]:
    """The runners to time and a one-line description of each.

    ``model`` is a float32 vitflow model in eval mode; ONNX files go to ``workdir``.
    """

    runners: dict[str, Runner] = {}
    notes: dict[str, str] = {}
    bf16 = cpu_bf16_supported()
    backend = getattr(model.blocks[0].attn, "backend", "?")
    if {"timm_eager_fp32", "timm_eager_bf16"} & set(paths):
        timm = timm_model(info.model_args)
        state = model.state_dict()
        if {k: v.shape for k, v in timm.state_dict().items()} == {k: v.shape for k, v in state.items()}:
            timm.load_state_dict(state)  # same layout (not pruned, timm options): same numbers, fair timing
        elif family_of(info.model_args["name"]).name != "vit":
            raise ValueError(f"timm's {info.model_args['name']} does not take the checkpoint's weights (other names "
                             "or shapes): no fair comparison")
        runners["timm_eager_fp32"], notes["timm_eager_fp32"] = timm, f"timm {type(timm).__name__}, fp32"
        runners["timm_eager_bf16"], notes["timm_eager_bf16"] = _bf16(timm), "timm, bf16 weights"
    runners["eager_fp32"], notes["eager_fp32"] = model, f"vitflow, fp32, attention={backend}"
    runners["eager_bf16"], notes["eager_bf16"] = _bf16(model), f"vitflow, bf16 weights, attention={backend}"
    if "compiled" in paths:
        if bf16:
            cm = torch.compile(copy.deepcopy(model).to(torch.bfloat16), dynamic=False)
            runners["compiled"] = lambda x: cm(x.to(torch.bfloat16))
        else:
            runners["compiled"] = torch.compile(copy.deepcopy(model), dynamic=False)
        notes["compiled"] = f"torch.compile (inductor), {'bf16' if bf16 else 'fp32'} weights"
    if {"onnxruntime_fp32", "onnxruntime_int8"} & set(paths):
        workdir = Path(workdir)
        export_onnx(model, workdir / "model.onnx", info)
        fused = optimize_onnx(workdir / "model.onnx", workdir / "model.opt.onnx", target="cpu")
        runners["onnxruntime_fp32"] = OnnxModel(workdir / "model.opt.onnx")
        notes["onnxruntime_fp32"] = "ONNX Runtime CPU, fp32, fused " + ", ".join(f"{k} {v}" for k, v in fused.items())
        if "onnxruntime_int8" in paths:
            quantize_onnx(workdir / "model.opt.onnx", workdir / "model.int8.onnx")
            runners["onnxruntime_int8"] = OnnxModel(workdir / "model.int8.onnx")
            notes["onnxruntime_int8"] = "ONNX Runtime CPU, dynamic INT8 (per-channel weights)"
    keep = {k: v for k, v in runners.items() if k in paths}
    return keep, {k: notes[k] for k in keep}


@torch.inference_mode()
def time_paths(runners: dict[str, Runner], image_size: int, batch_size: int = 32, repeats: int = 3,
               latency_calls: int = 20, min_time: float = 1.0, log: Callable[[str], None] = print
               ) -> dict[str, Timing]:
    """Time every runner (see the module docstring for the protocol).

    Returns:
        ``{path: Timing}``.
    """
    x1 = torch.randn(1, 3, image_size, image_size)
    xb = torch.randn(batch_size, 3, image_size, image_size)
    for name, run in runners.items():
        t0 = time.perf_counter()
        for x in (x1, x1, xb, xb):
            run(x)
        log(f"warm-up {name}: {time.perf_counter() - t0:.1f} s")
    timings = {name: Timing() for name in runners}
    for r in range(repeats):
        for name, run in runners.items():
            time.sleep(IDLE_GAP_S)  # let the previous path's spinning worker threads go idle
            t = timings[name]
            for _ in range(latency_calls):
                t0 = time.perf_counter()
                run(x1)
                t.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            n, t0 = 0, time.perf_counter()
            while n < 2 or time.perf_counter() - t0 < min_time:
                run(xb)
                n += 1
            t.throughputs.append(n * batch_size / (time.perf_counter() - t0))
        log(f"round {r + 1}/{repeats}: " + "  ".join(f"{k} {v.throughputs[-1]:.0f}" for k, v in timings.items()))
    return timings


def bench_infer(checkpoint: str | Path, paths: tuple[str, ...] = PATHS, batch_size: int = 32, repeats: int = 3,
                latency_calls: int = 20, min_time: float = 1.0, attention: str | None = None,
                log: Callable[[str], None] = print) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Benchmark a checkpoint along ``paths``.

    Args:
        attention: attention backend for the vitflow eager / compiled paths (default: the
            checkpoint's).
    Returns:
        ``({path: {"latency_ms_p50", "latency_ms_p90", "throughput_ips"}}, {path: description})``.
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, unknown path, timm missing.
    """

    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"unknown benchmark path(s) {unknown}; choose from {list(PATHS)}")
    state = load_checkpoint(checkpoint)
    if state.get("quantization"):
        raise ValueError(f"{checkpoint} is a quantized checkpoint; benchmark the float checkpoint it came from")
    model = model_from_checkpoint(state).float().eval()
    if attention:
        model.set_attention_backend(attention)
    info = ModelInfo.from_checkpoint(state)
    with tempfile.TemporaryDirectory() as tmp:
        runners, notes = build_paths(model, info, tmp, paths)
        timings = time_paths(runners, info.preprocess.image_size, batch_size, repeats, latency_calls, min_time, log)
    for k, t in timings.items():
        notes[k] += f"; rounds {min(t.throughputs):.0f}-{max(t.throughputs):.0f} img/s"
    if warning := busy_warning({k: t.throughputs for k, t in timings.items()}):
        log(f"warning: {warning}")
    return {k: timings[k].summary() for k in PATHS if k in timings}, notes


def format_table(results: dict[str, dict[str, float]], notes: dict[str, str], batch_size: int = 32) -> str:
    """A text table with each path's latency and throughput and their ratios to timm eager fp32
    (speed-ups: higher is faster), plus the best vitflow vs best timm line."""
    base = results.get(BASELINE)
    lines = [f"{'path':18s} {'b1 p50 ms':>9s} {'b1 p90 ms':>9s} {f'b{batch_size} img/s':>10s} "
             f"{'lat x':>6s} {'tput x':>6s}  what"]
    for k, r in results.items():
        lat_x = f"{base['latency_ms_p50'] / r['latency_ms_p50']:.2f}" if base else "-"
        tp_x = f"{r['throughput_ips'] / base['throughput_ips']:.2f}" if base else "-"
        lines.append(f"{k:18s} {r['latency_ms_p50']:9.2f} {r['latency_ms_p90']:9.2f} {r['throughput_ips']:10.1f} "
                     f"{lat_x:>6s} {tp_x:>6s}  {notes.get(k, '')}")
    ours = {k: v for k, v in results.items() if not k.startswith("timm")}
    theirs = {k: v for k, v in results.items() if k.startswith("timm")}
    if ours and theirs:
        bo = max(ours, key=lambda k: ours[k]["throughput_ips"])
        bt = max(theirs, key=lambda k: theirs[k]["throughput_ips"])
        lines.append(f"best vitflow path {bo} {ours[bo]['throughput_ips']:.1f} img/s = "
                     f"{ours[bo]['throughput_ips'] / theirs[bt]['throughput_ips']:.2f}x timm's best path {bt} "
                     f"{theirs[bt]['throughput_ips']:.1f} img/s (batch {batch_size})")
    return "\n".join(lines)
