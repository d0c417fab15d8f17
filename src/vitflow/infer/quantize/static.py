"""Static INT8 with calibration for ONNX Runtime (``vitflow quantize --calibrate``).

Weights are quantised to signed 8 bits per output channel ahead of time, as in dynamic INT8
(:func:`vitflow.infer.quantize.dynamic.quantize_onnx`); the activations entering every linear layer get
a scale and zero point *calibrated* once on real images, so the graph needs no run-time range
search (``DynamicQuantizeLinear``): ONNX Runtime runs each linear layer as an integer GEMM with a
float output (``MatMulIntegerToFloat``; VNNI / AMX-INT8 kernels where the CPU has them). The
model is written in the QDQ format (``QuantizeLinear`` / ``DequantizeLinear`` pairs around the
float ops), which every ONNX runtime reads; the layers' outputs, LayerNorm, softmax, GELU and the
attention products of two activations stay in float. The activation ranges come from one of three
calibration methods (ONNX Runtime's ``quantize_static`` calibrators): ``minmax`` (the observed
range), ``percentile`` (99.999th percentile of ``|x|``) or ``entropy`` (the range minimising the
KL divergence of the quantised histogram, Migacz 2017, "8-bit Inference with TensorRT"); the
accuracy guard of ``vitflow quantize`` tries them and keeps the best (Jacob et al. 2018 for the
integer scheme; Wu et al. 2020, "Integer Quantization for Deep Learning Inference", for the
calibration methods).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.infer.calibration import CALIBRATION_IMAGES, calibration_images
from vitflow.infer.export.formats import export_onnx, fusion_sizes, optimize_onnx
from vitflow.infer.quantize.guard import Guard, guard_source
from vitflow.infer.runtimes.onnx import (
    INPUT_NAME,
    ModelInfo,
    OnnxModel,
    copy_metadata,
    is_onnx,
    quiet_toolchain,
    require,
)
from vitflow.infer.runtimes.openvino import OpenVinoModel, convert_onnx, is_openvino, nncf_quantize, save_ir

METHODS = ("minmax", "percentile", "entropy")
QUANTIZED_OPS = ("MatMul", "Gemm", "Conv")  # the linear layers and the patch embedding
CALIBRATION_BATCH = 8
log = logging.getLogger(__name__)


def calibration_reader(images: torch.Tensor, input_name: str = INPUT_NAME, batch: int = CALIBRATION_BATCH):
    """An ONNX Runtime ``CalibrationDataReader`` over ``images`` (``float32 (N, 3, S, S)``,
    normalised model inputs), ``batch`` at a time; it supports ``set_range`` so the calibrator
    keeps one batch of intermediate outputs at a time (``CalibStridedMinMax``), not all of them."""
    require("onnxruntime")
    from onnxruntime.quantization import CalibrationDataReader

    batches = [np.ascontiguousarray(images[i:i + batch].numpy()) for i in range(0, len(images), batch)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.start, self.end = 0, len(batches)

        def __len__(self) -> int:
            return len(batches)

        def set_range(self, start_index: int, end_index: int) -> None:
            self.start, self.end = start_index, min(end_index, len(batches))

        def get_next(self):
            if self.start >= self.end:
                return None
            self.start += 1
            return {input_name: batches[self.start - 1]}

    return Reader()


def pre_process(src: str | Path, dst: str | Path) -> None:
    """ONNX Runtime's ``quant_pre_process`` (graph optimisation and shape inference before
    quantising). Its symbolic shape inference cannot follow every graph (token merging's top-k
    and scatter-add sizes: a ``TypeError`` inside it); such a graph is then pre-processed with
    ONNX's own shape inference instead (``skip_symbolic_shape``)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst), skip_optimization=False, skip_symbolic_shape=False)
    except Exception as e:  # noqa: BLE001 - the symbolic inference's own failures (TypeError, AssertionError...)
        log.info("ONNX Runtime's symbolic shape inference failed on %s (%s: %s); using ONNX's shape inference",
                 src, type(e).__name__, e)
        quant_pre_process(str(src), str(dst), skip_optimization=False, skip_symbolic_shape=True)


def quantize_onnx_static(src: str | Path, dst: str | Path, images: torch.Tensor, method: str = "minmax",
                         per_channel: bool = True) -> dict[str, int]:
    """Static INT8 (QDQ) of a float32 ONNX model, activation ranges calibrated on ``images``.

    Args:
        src: a float32 ONNX model (:func:`vitflow.infer.export.formats.export_onnx`, optionally fused by
            ``optimize_onnx``).
        dst: output path; gets ``src``'s vitflow metadata.
        images: ``float32 (N, 3, S, S)`` normalised real images (a few hundred:
            :func:`vitflow.infer.calibration.calibration_images`).
        method: ``minmax``, ``percentile`` or ``entropy`` (see the module docstring).
        per_channel: one weight scale per output channel (else one per tensor).
    Returns:
        ``{op_type: count}`` of the ``QuantizeLinear`` / ``DequantizeLinear`` nodes in ``dst``.
    Raises:
        ValueError: unknown ``method``; ``images`` of another size than the model's input.
    """
    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    calib = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
             "entropy": CalibrationMethod.Entropy}
    if method not in calib:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {list(METHODS)}")
    with tempfile.TemporaryDirectory() as tmp, quiet_toolchain():
        pre = Path(tmp) / "pre.onnx"
        pre_process(src, pre)
        graph = onnx.load(str(pre), load_external_data=False).graph
        weights = {i.name for i in graph.initializer}
        products = [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] not in weights]
        # inputs quantized, outputs float: ONNX Runtime runs each linear as MatMulIntegerToFloat (measured on
        # AMX: quantized outputs (QLinearMatMul + Q/DQ pairs) and quantized attention products were slower)
        quantize_static(pre, Path(dst), calibration_reader(images), quant_format=QuantFormat.QDQ,
                        per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_exclude=products,
                        calibrate_method=calib[method],
                        extra_options={"CalibStridedMinMax": 1, "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS)})
    copy_metadata(src, dst)
    counts: dict[str, int] = {}
    for node in onnx.load(str(dst), load_external_data=False).graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------
# `vitflow quantize --calibrate` / `--backend openvino`: calibration, candidates, the guard


def float_onnx(model_path: str | Path, workdir: Path, state: dict | None = None) -> tuple[OnnxModel, Path]:
    """The float32 ONNX model to quantise: a vitflow ``.onnx`` as it is, or a checkpoint
    (``state``, loaded from ``model_path`` when not given) exported with the CPU fusions
    (``optimize_onnx``) into ``workdir``; returns ``(model, path)``."""
    if is_onnx(model_path):
        return OnnxModel(model_path), Path(model_path)
    state = state or load_checkpoint(model_path)
    info, src, model = ModelInfo.from_checkpoint(state), workdir / "fp32.onnx", model_from_checkpoint(state)
    export_onnx(model, src, info)
    optimize_onnx(src, src, "cpu", *fusion_sizes(model))
    return OnnxModel(src), src


def model_info(model_path: str | Path) -> tuple[ModelInfo, dict | None]:
    """``(info, checkpoint state or None)`` of a checkpoint or vitflow ``.onnx``; raises ValueError
    for a quantized checkpoint."""
    if is_onnx(model_path):
        return OnnxModel(model_path).info(), None
    state = load_checkpoint(model_path)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is already quantized ({state['quantization']})")
    return ModelInfo.from_checkpoint(state), state


def _candidate(backend: str, method: str, src: Path, images: torch.Tensor, dst: Path, per_channel: bool,
               batch: int | None, meta: dict[str, str]) -> torch.nn.Module:
    """One quantised candidate written to ``dst`` and loaded back."""
    if backend == "openvino":
        save_ir(nncf_quantize(convert_onnx(src, batch), images), dst, meta)
        return OpenVinoModel(dst)
    quantize_onnx_static(src, dst, images, method, per_channel)
    return OnnxModel(dst)


def quantize_calibrated(model_path: str | Path, out: str | Path, backend: str = "onnxruntime",
                        calibration: str | None = None, data: str | None = None, split: str | None = None,
                        methods: tuple[str, ...] = METHODS, max_drop: float = 1.0, force: bool = False,
                        per_channel: bool = True, images: int = CALIBRATION_IMAGES, batch: int | None = None,
                        log: Callable[[str], None] = print) -> dict:
    """Static INT8 of a checkpoint or vitflow ``.onnx`` calibrated on real images, guarded by
    top-1 (mAP): ``onnxruntime`` (QDQ ONNX, :func:`quantize_onnx_static`, each of ``methods``
    tried, the best kept) or ``openvino`` (an IR quantised by NNCF,
    :func:`vitflow.infer.runtimes.openvino.nncf_quantize`).

    Args:
        calibration: images to calibrate on (:func:`vitflow.infer.calibration.calibration_images`;
            default the checkpoint's training data), ``images`` of them.
        data / split: the guard's labelled images (default: the checkpoint's test split; without
            any, no guard and the first method only).
        batch: OpenVINO: fix the IR's batch dimension (static shape).
    Returns:
        ``{"path", "bytes", "method", "methods": {method: figure after}, "calibration_images",
        "top1_before", "top1_after", "drop_points", "images", "written"}`` (guard keys with a guard).
    Raises:
        AccuracyDropError: even the best candidate lost more than ``max_drop`` (``out`` not written).
        ValueError: bad calibration data (one line), unknown method, an op OpenVINO cannot convert.
    """
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise ValueError(f"unknown calibration method(s) {unknown}; choose from {list(METHODS)}")
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        info, state = model_info(model_path)
        x = calibration_images(calibration, info.preprocess, info.classes, state, images)  # bad data: before any work
        source, label = guard_source(info, data, split, state)
        reference, src = float_onnx(model_path, Path(tmp), state)
        guard = Guard(reference, info, source, label, max_drop, force, log) if source is not None else None
        candidates = ("nncf",) if backend == "openvino" else tuple(methods)
        if guard is None:
            log(f"no labelled images to guard top-1 (give --data): {candidates[0]}, unguarded")
            candidates = candidates[:1]
        scores: dict[str, float | None] = {}
        for method in candidates:
            dst = Path(tmp) / f"{method}{out.suffix}"
            model = _candidate(backend, method, src, x, dst, per_channel, batch, reference.metadata)
            scores[method] = guard.measure(model)[0] if guard else None
            if guard:
                log(f"{method}: {guard.name} {scores[method]:.2%} (drop {guard.drop(scores[method]):.2f} points)")
        best = max(scores, key=lambda m: scores[m] or 0.0)
        tried = f", best of {', '.join(scores)}" if len(scores) > 1 else ""
        result = guard.check(scores[best], out, tried) if guard else {}
        _publish(Path(tmp) / f"{best}{out.suffix}", out)
    return {"path": str(out), "bytes": sum(f.stat().st_size for f in _files(out)), "method": best,
            "methods": scores, "calibration_images": len(x), **result, "written": True}


def _files(path: Path) -> list[Path]:
    """The files of a model: an IR's ``.xml`` and ``.bin``, else the file itself."""
    return [path, path.with_suffix(".bin")] if is_openvino(path) else [path]


def _publish(src: Path, out: Path) -> None:
    """Move the model at ``src`` (with its ``.bin`` for an IR) to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for a, b in zip(_files(src), _files(out)):
        shutil.move(str(a), str(b))
