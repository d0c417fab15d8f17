"""Which backend serves a model, decided once in the parent process before any worker starts.

``--backend``:

==============  ================================================================================
``eager_fp32``  the PyTorch model in float32 (``vitflow predict``'s default)
``eager_bf16``  the PyTorch model with bf16 weights (``vitflow predict --precision bf16``)
``onnxruntime`` ONNX Runtime on the CPU: an ``.onnx`` / INT8 ``.onnx`` source as it is; a checkpoint
                is exported at start-up (``export_onnx`` + the CPU fusions of ``optimize_onnx``,
                as ``vitflow export --optimize`` and ``bench infer``'s ``onnxruntime_fp32`` path)
``openvino``    OpenVINO on the CPU: an OpenVINO IR source (``.xml``, from ``vitflow export --format
                openvino`` or ``vitflow quantize --backend openvino``) as it is, with vitflow's tuned
                settings (``tuned_settings``: bf16 float layers where the CPU has native bf16, else fp32;
                the throughput hint's streams) but dynamic shapes, logged at start-up
``auto``        an ONNX source: ``onnxruntime``; an IR: ``openvino``; a checkpoint or run folder: the faster of
                ``eager_fp32``, ``onnxruntime`` and (on CPUs with native bf16) ``eager_bf16``,
                timed with ``bench infer``'s protocol (:func:`vitflow.infer.bench.timing.time_paths`)
                at ``--max-batch`` images a call; a hub folder: ``eager_fp32``
==============  ================================================================================

INT8 is never chosen by ``auto``: its accuracy guard lives in ``vitflow quantize``, whose output
file is then served as it is. Which runtime loads which file stays in
:meth:`vitflow.infer.predict.Predictor.load`; this module only picks the precision and, for
``onnxruntime`` on a checkpoint, the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
from pathlib import Path
from typing import Callable

from vitflow.infer.predict import Predictor, is_exported
from vitflow.infer.runtimes.onnx import is_onnx
from vitflow.infer.runtimes.openvino import is_openvino
from vitflow.infer.serve.settings import ServeSettings

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager_fp32", "eager_bf16", "onnxruntime", "openvino")
PRECISION = {"eager_fp32": "fp32", "eager_bf16": "bf16", "onnxruntime": "fp32"}  # (openvino: its own loader)
RUNTIMES = {"onnxruntime": ("an ONNX model", is_onnx), "openvino": ("an OpenVINO IR", is_openvino)}


def load_predictor(s: ServeSettings) -> Predictor:
    """The :class:`Predictor` of prepared settings (``s.load_path`` and a concrete ``s.backend``),
    with ``s.tta`` applied. Raises FileNotFoundError / ValueError as :meth:`Predictor.load`."""
    if s.backend == "openvino":  # dynamic shapes: a server runs every batch size from 1 to --max-batch, and a
        # static copy compiled for each while serving cost 0.68x the images/s at 16 clients (the serving guide)
        p = Predictor.from_openvino(s.load_path or s.source, "tuned", static_shapes=False)
    else:
        p = Predictor.load(s.load_path or s.source, s.device, PRECISION[s.backend], s.weights)
    p.set_tta(s.tta)
    return p


def content_version(path: str | Path) -> str:
    """``sha256:`` and the first 12 hex digits of the hash of a file's bytes (of a folder: of its
    files' names and bytes, in sorted order): the model version in every answer."""
    h, p = hashlib.sha256(), Path(path)
    for f in sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(2**20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()[:12]


def _export_for_onnxruntime(source: str, workdir: Path, weights: str) -> tuple[str, str]:
    """The checkpoint (a run folder: its newest) as an ONNX file with the CPU fusions (``vitflow
    export --optimize --target cpu``) in ``workdir``: ``(onnx path, checkpoint path)``."""
    from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
    from vitflow.infer.export.formats import export_onnx, optimize_onnx
    from vitflow.infer.runtimes.onnx import ModelInfo, quiet_toolchain

    state = load_checkpoint(source)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is an INT8 PyTorch checkpoint: serve it with --backend eager_fp32, or "
                         "quantize the ONNX export with `vitflow quantize` and serve that file")
    model = model_from_checkpoint(state, weights).float().eval()
    with quiet_toolchain():
        export_onnx(model, workdir / "model.onnx", ModelInfo.from_checkpoint(state))
        optimize_onnx(workdir / "model.onnx", workdir / "model.opt.onnx", target="cpu")
    return str(workdir / "model.opt.onnx"), state["path"]


def _candidates(s: ServeSettings, checkpoint: bool) -> list[str]:
    from vitflow.runtime import cpu_bf16_supported

    for runtime, (what, test) in RUNTIMES.items():
        if test(s.source):
            if s.backend not in ("auto", runtime):
                raise ValueError(f"--backend {s.backend}: {s.source} is {what}; it runs on --backend {runtime} "
                                 "(or auto)")
            return [runtime]
    if s.backend == "openvino":
        raise ValueError(f"--backend openvino: {s.source} is not an OpenVINO IR; export it with `vitflow export "
                         "--format openvino` and serve the .xml file")
    if s.backend != "auto":
        if s.backend == "onnxruntime" and not checkpoint:
            raise ValueError(f"--backend onnxruntime: {s.source} is a hub folder; export a checkpoint with "
                             "`vitflow export --format onnx` and serve the .onnx file")
        return [s.backend]
    out = ["eager_fp32"]
    if checkpoint and _has_onnxruntime():
        out.append("onnxruntime")
    if cpu_bf16_supported() and s.device in ("auto", "cpu"):
        out.append("eager_bf16")
    return out


def _has_onnxruntime() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def prepare(s: ServeSettings, workdir: str | Path, say: Callable[[str], None] = log.info) -> ServeSettings:
    """Complete ``s`` in the parent process: load the model once (so that a bad source fails here
    with one line), choose the backend (timed when ``auto``), export the ONNX file the workers
    load when the backend is ``onnxruntime`` on a checkpoint (into ``workdir``, which must outlive
    the workers), and hash the loaded file for the version.

    Returns:
        a copy of ``s`` with ``backend`` concrete, ``load_path``, ``name``, ``version`` and
        ``choice`` (``{backend: images/s}`` when timed) set.
    Raises:
        FileNotFoundError / ValueError: no such source, an unreadable model, a backend this
            source cannot run on (the message names the option).
    """
    from vitflow.infer.export.hub_folder import is_hub_folder

    s.check()
    if s.backend not in BACKENDS:
        raise ValueError(f"--backend {s.backend!r}: choose one of {', '.join(BACKENDS)}")
    checkpoint = not is_exported(s.source) and not is_hub_folder(s.source)
    loaded: dict[str, tuple[Predictor, str, str]] = {}  # backend -> (predictor, file it loads, model origin)
    for backend in _candidates(s, checkpoint):
        try:
            if backend == "onnxruntime" and checkpoint:
                path, origin = _export_for_onnxruntime(s.source, Path(workdir), s.weights)
                loaded[backend] = (load_predictor(dataclasses.replace(s, backend=backend, load_path=path)), path,
                                   origin)
            else:
                p = load_predictor(dataclasses.replace(s, backend=backend, load_path=s.source))
                loaded[backend] = (p, p.name, p.name)  # p.name: a run folder's newest checkpoint, as predict reads it
        except ValueError as e:
            if s.backend != "auto" or backend == "eager_fp32":
                raise
            log.info("backend auto: %s left out (%s)", backend, e)
    choice = _time_backends({k: v[0] for k, v in loaded.items()}, s.max_batch, say) if len(loaded) > 1 else None
    backend = max(choice, key=choice.get) if choice else next(iter(loaded))
    _, path, origin = loaded[backend]
    return dataclasses.replace(s, backend=backend, load_path=path, origin=origin, choice=choice,
                               name=s.name or Path(s.source.rstrip("/")).stem, version=content_version(origin))


def _time_backends(predictors: dict[str, Predictor], batch: int, say: Callable[[str], None]) -> dict[str, float]:
    """Images/s of each predictor's model at ``batch`` images a call (``bench infer``'s protocol,
    2 interleaved rounds of 0.3 s)."""
    from vitflow.infer.bench.timing import time_paths

    runners = {k: (lambda x, p=p: p.model(x.to(p.device, p.dtype))) for k, p in predictors.items()}
    size = next(iter(predictors.values())).pp.image_size
    timings = time_paths(runners, size, batch_size=batch, repeats=2, latency_calls=2, min_time=0.3, log=log.debug)
    ips = {k: round(statistics.median(t.throughputs), 1) for k, t in timings.items()}
    say("backend auto: " + ", ".join(f"{k} {v:.0f} images/s" for k, v in ips.items()) + f" at batch {batch}")
    return ips
