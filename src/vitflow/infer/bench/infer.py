"""``vitflow bench infer``: inference speed (and, with real data, top-1) of one checkpoint along
every deployment path, side by side with the peers, in one process. The paths are the rows of
:data:`vitflow.infer.bench.paths.PATHS`: timm's model of the same configuration and weights in
eager PyTorch, exported to ONNX Runtime (fp32, dynamic and static INT8) and to OpenVINO (f32,
bf16, INT8 by NNCF); vitflow's model eager, compiled, in ONNX Runtime and in OpenVINO.

The timing protocol is :mod:`vitflow.infer.bench.timing`'s. With real data each path's top-1
is measured on the same decoded images.
"""

from __future__ import annotations

import fnmatch
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.data import ImageSource, eval_loader, model_input
from vitflow.infer.bench.paths import PATHS, Sources
from vitflow.infer.bench.timing import cpu_flags, ratio, time_paths
from vitflow.infer.calibration import CALIBRATION_IMAGES, calibration_images, checkpoint_split
from vitflow.infer.runtimes.onnx import ModelInfo, UnavailableError
from vitflow.infer.token_merge import choose_token_merge
from vitflow.models.token_merging import check_mergeable
from vitflow.timing import busy_warning

BASELINE = "timm_eager_fp32"
PEER_INT8 = "timm_openvino_int8"  # the peer to beat (issue 44)


def select_paths(spec: str | None) -> tuple[str, ...]:
    """The paths a ``--paths`` value names, in table order: comma-separated names or shell
    patterns (``openvino_*``, ``*int8*``); ``None``: every path whose packages are installed
    (``timm``, ``onnxruntime``, ``openvino`` + ``nncf``).

    Raises:
        ValueError: a name or pattern that matches no path (the message lists them).
    """
    if not spec:
        return tuple(p for p, row in PATHS.items() if not row.missing())
    chosen: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        hit = fnmatch.filter(PATHS, part)
        if not hit:
            raise ValueError(f"unknown benchmark path {part!r}; choose from {list(PATHS)} (shell patterns work)")
        chosen.update(hit)
    return tuple(p for p in PATHS if p in chosen)


def build_paths(model: torch.nn.Module, info: ModelInfo, workdir: str | Path, paths: tuple[str, ...] = tuple(PATHS),
                calibration: Callable[[], torch.Tensor] | None = None, log: Callable[[str], None] = print,
                peer: tuple[torch.nn.Module, ModelInfo] | None = None, token_merge: int | list[int] | None = None
                ) -> tuple[dict[str, torch.nn.Module], dict[str, str]]:
    """The modules to time and a one-line description of each (see :mod:`vitflow.infer.bench.paths`).

    ``model`` is a float32 vitflow model in eval mode; ONNX files go to ``workdir``;
    ``calibration`` returns the real images of the static INT8 paths; ``peer``: the model (and
    its info) the timm paths take their configuration and weights from (default ``model``);
    ``token_merge``: the ``tome_*`` paths' ``r`` (default
    :func:`~vitflow.models.token_merging.default_merge`); a model that cannot merge leaves them
    out (logged).
    """
    def no_images() -> torch.Tensor:
        raise ValueError("the static INT8 paths need calibration images: give the checkpoint's data or --calibrate")

    sources = Sources(model.float().eval(), info, workdir, calibration or no_images, peer, token_merge)
    runners, notes = {}, {}
    mergeable = _mergeable(model)
    for name in paths:
        if missing := PATHS[name].missing():
            raise UnavailableError(f"benchmark path {name} needs {' and '.join(missing)} (pip install "
                                   "'vitflow[export,openvino]' timm); leave it out of --paths")
        if name.startswith("tome_") and mergeable is not True:
            log(f"{name} left out: {mergeable}")
            continue
        t0 = time.perf_counter()
        runners[name] = PATHS[name].build(sources)
        notes[name] = PATHS[name].what + (f" (r={sources.merged().token_merge})" if name.startswith("tome_") else "")
        log(f"built {name} in {time.perf_counter() - t0:.1f} s")
    if "timm_eager_fp32" in runners:
        notes["timm_eager_fp32"] = f"timm {type(runners['timm_eager_fp32']).__name__}, fp32 eager (the baseline)"
    return runners, notes


def _mergeable(model: torch.nn.Module) -> bool | str:
    """True, or why ``model`` cannot take token merging (one line)."""
    if not hasattr(model, "set_token_merge"):
        return f"token merging is for the ViT family, not {type(model).__name__}"
    try:
        check_mergeable(model)
    except ValueError as e:
        return str(e)
    return True


@torch.inference_mode()
def top1_of(runners: dict[str, torch.nn.Module], source: ImageSource, info: ModelInfo,
            batch_size: int = 64) -> dict[str, float]:
    """Top-1 (a fraction) of every runner on the same images of ``source``, decoded once through
    the eval transform, in batches of ``batch_size`` (``bench infer`` passes the batch size it
    times: ONNX Runtime's memory arena keeps what the largest batch needed, about 2 GiB a session
    for Swin-T at 64). Raises ValueError when no image can be read."""
    pp, batches = info.preprocess, []
    for b in eval_loader(source, pp, batch_size, 2):
        if len(b["labels"]):
            batches.append((model_input(b["images"], pp.mean, pp.std), b["labels"]))
    if not batches:
        raise ValueError("no readable image to measure top-1 on")
    images = sum(len(y) for _, y in batches)
    return {name: sum(int((run(x).float().argmax(1) == y).sum()) for x, y in batches) / images
            for name, run in runners.items()}


def _float_state(path: str | Path) -> dict:
    """A float checkpoint's state; raises ValueError for a quantized one."""
    state = load_checkpoint(path)
    if state.get("quantization"):
        raise ValueError(f"{path} is a quantized checkpoint; benchmark the float checkpoint it came from")
    return state


def bench_infer(checkpoint: str | Path, paths: tuple[str, ...] = tuple(PATHS), batch_size: int = 32,
                repeats: int = 3, latency_calls: int = 20, min_time: float = 1.0, attention: str | None = None,
                log: Callable[[str], None] = print, data: str | None = None, split: str | None = None,
                calibrate: str | None = None, calibration_count: int = CALIBRATION_IMAGES,
                reference: str | None = None, token_merge: int | str | None = None, max_drop: float = 1.0) -> dict:
    """Benchmark a checkpoint along ``paths``.

    Args:
        attention: attention backend for the vitflow eager / compiled paths (default: the
            checkpoint's).
        data / split: measure each path's top-1 on this split (default split: its test split,
            else its validation split); ``data=""``: the checkpoint's own data.
        calibrate / calibration_count: the static INT8 paths' calibration images
            (:func:`vitflow.infer.calibration.calibration_images`; default the checkpoint's
            training data).
        reference: the model the peers (timm paths) and the ``ov_best_*`` yardstick (through
            vitflow's export) run, e.g. the unpruned model a pruned ``checkpoint`` came from; its fp32
            top-1 is then the accuracy bound of the fastest paths (``timm_eager_fp32``'s).
        token_merge: the ``tome_*`` paths' tokens merged per block: an int, ``"auto"`` (the
            largest within ``max_drop`` points on ``data``, :func:`vitflow.infer.token_merge.choose_token_merge`)
            or ``None`` (:func:`~vitflow.models.token_merging.default_merge`).
    Returns:
        ``{"results": {path: {"latency_ms_p50", "latency_ms_p90", "throughput_ips"[, "top1"]}},
        "notes": {path: description}, "timings": {path: Timing}, "cpu_flags": [...],
        "fp32_top1": the bound's top-1 (``eager_fp32``'s, or ``timm_eager_fp32``'s with a
        ``reference``; measured even when that path is not among ``paths``), None without data,
        "token_merge": the guard's choice and curve with ``token_merge="auto"``}``.
    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, unknown path, timm or OpenVINO
        missing, bad calibration data.
    """
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"unknown benchmark path(s) {unknown}; choose from {list(PATHS)}")
    state = _float_state(checkpoint)
    model = model_from_checkpoint(state).float().eval()
    if attention:
        model.set_attention_backend(attention)
    info = ModelInfo.from_checkpoint(state)
    peer = _peer(reference, info.classes, checkpoint)
    source = checkpoint_split(state, data or None, split) if data is not None else None  # bad data: before any work
    calibration = lambda: calibration_images(calibrate, info.preprocess, info.classes, state, calibration_count)  # noqa: E731
    if getattr(model, "token_merge", 0):
        log(f"{checkpoint} merges tokens (r={model.token_merge}, vitflow merge-tokens): every vitflow path runs "
            "merged")
    token_merge, paths, choice = _merge_choice(token_merge, paths, model, info, source, max_drop, log)
    with tempfile.TemporaryDirectory() as tmp:
        runners, notes = build_paths(model, info, tmp, paths, calibration, log, peer, token_merge)
        bound = BASELINE if peer is not None else "eager_fp32"  # whose fp32 top-1 bounds the drop
        measured = runners if bound in runners else {**runners, bound: peer[0] if peer is not None else model}
        accuracy = top1_of(measured, source, info, batch_size) if source is not None else {}
        timings = time_paths(runners, info.preprocess.image_size, batch_size, repeats, latency_calls, min_time, log)
    for k, t in timings.items():
        notes[k] += f"; rounds {min(t.throughputs):.0f}-{max(t.throughputs):.0f} img/s"
    if warning := busy_warning({k: t.throughputs for k, t in timings.items()}):
        log(f"warning: {warning}")
    results = {k: {**timings[k].summary(), **({"top1": accuracy[k]} if k in accuracy else {})}
               for k in PATHS if k in timings}
    return {"results": results, "notes": notes, "timings": timings, "cpu_flags": cpu_flags(),
            "fp32_top1": accuracy.get(bound), "token_merge": choice}


def _peer(reference: str | None, classes: list[str], checkpoint) -> tuple[torch.nn.Module, ModelInfo] | None:
    """The ``--reference`` model and its info (None without one). Raises ValueError: other classes."""
    if reference is None:
        return None
    ref = _float_state(reference)
    if list(ref["classes"]) != classes:
        raise ValueError(f"--reference {reference} has other classes than {checkpoint}")
    return model_from_checkpoint(ref).float().eval(), ModelInfo.from_checkpoint(ref)


def _merge_choice(token_merge: int | str | None, paths: tuple[str, ...], model: torch.nn.Module, info: ModelInfo,
                  source, max_drop: float, log: Callable[[str], None]
                  ) -> tuple[int | None, tuple[str, ...], dict | None]:
    """``(r for the tome_* paths, the paths, the guard's choice)``: with ``"auto"`` the guard
    chooses on ``source`` (:func:`~vitflow.infer.token_merge.choose_token_merge`); when no ``r``
    keeps within ``max_drop`` the ``tome_*`` paths are left out.

    Raises:
        ValueError: ``"auto"`` without data."""
    if token_merge != "auto":
        return token_merge, paths, None
    if not any(p.startswith("tome_") for p in paths) or _mergeable(model) is not True:
        return None, paths, None  # (build_paths says why a model that cannot merge has no tome_* paths)
    if source is None:
        raise ValueError("--token-merge auto chooses r on real images: give --data")
    choice = choose_token_merge(model, source, info, max_drop, log=log)
    if not choice["r"]:
        log(f"no token merging within {max_drop:g} points: the tome_* paths are left out")
        paths = tuple(p for p in paths if not p.startswith("tome_"))
    return choice["r"] or None, paths, choice


def _fastest(results: dict, timings: dict, group: str, figure: str, reference: float | None,
             max_drop: float) -> str | None:
    """The path of ``group`` (``peer`` / ``vitflow``) best at ``figure`` (``throughput_ips``
    highest, ``latency_ms_p50`` lowest) among those within ``max_drop`` top-1 points of
    ``reference`` (all when top-1 was not measured)."""
    ok = [k for k in results if PATHS[k].group == group and k in timings
          and (reference is None or "top1" not in results[k] or (reference - results[k]["top1"]) * 100 <= max_drop)]
    if not ok:
        return None
    return (max if figure == "throughput_ips" else min)(ok, key=lambda k: results[k][figure])


def format_table(bench: dict, batch_size: int = 32, max_drop: float = 1.0) -> str:
    """A text table of :func:`bench_infer`'s result: each path's latency and throughput, their
    ratios to timm eager fp32 (speed-ups: higher is faster) and top-1 when measured; then the CPU
    flags and, for batch throughput and batch-1 latency, vitflow's fastest path against the peers'
    fastest and against OpenVINO INT8 (per-round median ratios, among paths within ``max_drop``
    top-1 points of fp32)."""
    results, notes, timings = bench["results"], bench["notes"], bench["timings"]
    base = results.get(BASELINE)
    lines = [f"{'path':28s} {'b1 p50 ms':>9s} {'b1 p90 ms':>9s} {f'b{batch_size} img/s':>10s} "
             f"{'lat x':>6s} {'tput x':>6s} {'top-1':>7s}  what"]
    for k, r in results.items():
        lat_x = f"{base['latency_ms_p50'] / r['latency_ms_p50']:.2f}" if base else "-"
        tp_x = f"{r['throughput_ips'] / base['throughput_ips']:.2f}" if base else "-"
        top1 = f"{r['top1']:.2%}" if "top1" in r else "-"
        lines.append(f"{k:28s} {r['latency_ms_p50']:9.2f} {r['latency_ms_p90']:9.2f} {r['throughput_ips']:10.1f} "
                     f"{lat_x:>6s} {tp_x:>6s} {top1:>7s}  {notes.get(k, '')}")
    lines.append(f"CPU flags: {' '.join(bench['cpu_flags']) or 'unknown'}; {torch.get_num_threads()} threads")
    fp32 = bench.get("fp32_top1")
    for figure, what, unit in (("throughput_ips", f"batch-{batch_size} throughput", "img/s"),
                               ("latency_ms_p50", "batch-1 latency", "ms")):
        ours = _fastest(results, timings, "vitflow", figure, fp32, max_drop)
        yardsticks = (_fastest(results, timings, "peer", figure, fp32, max_drop), PEER_INT8,
                      _fastest(results, timings, "openvino", figure, fp32, max_drop))
        for theirs in dict.fromkeys(y for y in yardsticks if y):
            if ours and theirs in timings:
                x = ratio(timings[ours], timings[theirs])["throughput" if figure == "throughput_ips" else "latency"]
                lines.append(f"{what}: vitflow's fastest {ours} {results[ours][figure]:.1f} {unit} = {x:.2f}x "
                             f"{theirs} {results[theirs][figure]:.1f} {unit} (median of per-round ratios)")
    if fp32 is not None:
        lines.append(f"fastest paths chosen among those within {max_drop:g} top-1 point(s) of fp32 ({fp32:.2%})")
    return "\n".join(lines)
