"""Quantisation for deployment: INT8 with ONNX Runtime or PyTorch, FP16/BF16 weight casting,
and the accuracy guard that refuses a quantised model that lost too much top-1.

- ONNX Runtime dynamic INT8 (:func:`quantize_onnx`): weights of every MatMul/Gemm with a
  constant weight matrix quantised to signed 8 bits per output channel ahead of time,
  activations quantised per tensor at run time (``DynamicQuantizeLinear``); LayerNorm, softmax,
  GELU, the attention products of two activations and the patch-embedding convolution stay in
  float. On CPUs with AVX512-VNNI ONNX Runtime runs these as fused ``DynamicQuantizeMatMul`` int8
  GEMMs. (Jacob et al. 2018 for the integer scheme; ONNX Runtime's ``quantize_dynamic``.)
- PyTorch dynamic INT8 (:func:`quantize_torch`): ``torch.ao.quantization.quantize_dynamic`` on
  every ``nn.Linear`` (per-channel int8 weights, fbgemm/onednn kernels). Saved as a vitflow
  checkpoint tagged ``quantization: dynamic-int8`` that ``vitflow predict`` / ``eval`` load.
- :func:`cast_checkpoint`: FP16/BF16 copies of the weights for GPU inference (half the file).
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from pathlib import Path

import torch

from vitflow.checkpoint import apply_quantization, load_checkpoint, model_from_checkpoint, save_checkpoint
from vitflow.infer.calibration import CALIBRATION_IMAGES
from vitflow.infer.quantize.guard import Guard, guard_source, measured_split
from vitflow.infer.quantize.static import METHODS, float_onnx, model_info, pre_process, quantize_calibrated
from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel, copy_metadata, is_onnx, quiet_toolchain, require
from vitflow.infer.runtimes.openvino import is_openvino

log = logging.getLogger(__name__)


def quantize_onnx(src: str | Path, dst: str | Path, per_channel: bool = True) -> dict[str, int]:
    """Dynamic INT8 quantisation of an ONNX model (ONNX Runtime ``quant_pre_process`` for shape
    inference, then ``quantize_dynamic`` with ``QInt8`` weights, ``MatMulConstBOnly``).

    Args:
        src: a float32 ONNX model (e.g. from :func:`vitflow.infer.export.formats.export_onnx`; a graph
            fused by ``optimize_onnx`` works too: fused ``Attention`` becomes ``QAttention``).
        dst: output path; gets ``src``'s vitflow metadata.
        per_channel: one scale per output channel of each weight matrix (else one per tensor).
    Returns:
        ``{op_type: count}`` of the integer ops in ``dst``.
    """
    onnx = require("onnx")
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp, quiet_toolchain():
        pre = Path(tmp) / "pre.onnx"
        pre_process(src, pre)
        quantize_dynamic(pre, Path(dst), weight_type=QuantType.QInt8, per_channel=per_channel,
                         op_types_to_quantize=["MatMul", "Gemm", "Attention"],
                         extra_options={"MatMulConstBOnly": True})
    copy_metadata(src, dst)
    counts: dict[str, int] = {}
    for node in onnx.load(str(dst), load_external_data=False).graph.node:
        if "Integer" in node.op_type or node.op_type.startswith(("Q", "DynamicQuantize")):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def quantize_torch(model: torch.nn.Module) -> torch.nn.Module:
    """PyTorch dynamic INT8 of every ``nn.Linear`` (``torch.ao.quantization.quantize_dynamic``,
    ``qint8`` weights per output channel; activations quantised per batch at run time). Returns a
    new CPU model; ``model`` is not modified. Loading: see
    :func:`vitflow.checkpoint.model_from_checkpoint` (``quantization: dynamic-int8``)."""
    return apply_quantization(copy.deepcopy(model).cpu().eval(), "dynamic-int8")


def cast_checkpoint(state: dict, dtype: str) -> dict:
    """A checkpoint state whose floating-point weights are cast to ``dtype`` (``fp16`` or
    ``bf16``), without optimizer / scheduler / RNG state (an inference checkpoint).

    It loads like any checkpoint (weights are upcast into the fp32 model); run it in half
    precision on a GPU with ``vitflow predict --precision fp16``.

    Raises:
        ValueError: unknown ``dtype``.
    """
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise ValueError(f"cannot cast weights to {dtype!r}; choose fp16 or bf16")
    model = {k: v.to(dt) if v.is_floating_point() else v for k, v in state["model"].items()}
    return {**inference_state(state), "model": model, "weights_dtype": dtype}


def inference_state(state: dict) -> dict:
    """``state`` without what only training resumption needs (optimizer, scheduler, scaler, RNG,
    loader position)."""
    drop = {"optimizer", "scheduler", "scaler", "rng", "data", "path", "format", "version"}
    return {k: v for k, v in state.items() if k not in drop}


# ---------------------------------------------------------------------------------------------
# the `vitflow quantize` pipeline


class CastModel(torch.nn.Module):
    """Runs ``model`` (already cast to ``dtype``) on float32 input; returns float32 logits."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.to(self.dtype)).float()


def quantize_file(model_path: str | Path, out: str | Path, backend: str = "onnxruntime", dtype: str = "int8",
                  data: str | None = None, split: str | None = None, max_drop: float = 1.0, force: bool = False,
                  per_channel: bool = True, log=print, calibrate: bool = False, calibration: str | None = None,
                  methods: tuple[str, ...] = METHODS, images: int = CALIBRATION_IMAGES, batch: int | None = None
                  ) -> dict:
    """Quantise a checkpoint or ONNX model, optionally guarded by top-1 on real data.

    Args:
        model_path: a vitflow checkpoint, or (``onnxruntime`` / ``openvino`` backend) a vitflow ``.onnx``.
        out: the quantised model: ``.onnx`` (onnxruntime), a checkpoint ``.pt`` (torch) or an
            OpenVINO IR ``.xml`` (openvino; its ``.bin`` beside it).
        backend: ``onnxruntime`` (INT8 ONNX; a checkpoint is exported first), ``torch`` (INT8
            dynamic checkpoint, or an FP16/BF16 weight cast with ``dtype``) or ``openvino`` (INT8
            IR by NNCF, always calibrated).
        dtype: ``int8``; ``fp16`` / ``bf16`` (torch backend: weight casting).
        data: an image folder or tar to measure top-1 on before and after; the output is written
            only if top-1 dropped by at most ``max_drop`` percentage points, or with ``force``.
        split: the split of ``data`` (``test``, ``test[:2000]``, ...); ``None``:
            :func:`~vitflow.infer.quantize.guard.measured_split`.
        calibrate: static INT8 with activation ranges calibrated on ``images`` real images of
            ``calibration`` (default: the checkpoint's training data); the guard (on ``data``, by
            default the checkpoint's test split) picks the best of ``methods``. See
            :func:`vitflow.infer.quantize.static.quantize_calibrated` (``batch``: OpenVINO's fixed batch).
    Returns:
        ``{"path", "bytes", "ops", "top1_before", "top1_after", "drop_points",
        "images", "written"}`` (accuracy keys only with a guard; calibrated: also ``method``,
        ``methods`` and ``calibration_images``).
    Raises:
        AccuracyDropError: the drop exceeds ``max_drop`` (and not ``force``); ``out`` not written.
        FileNotFoundError / ValueError: unreadable model, unsupported combination, bad data.
    """
    _check_request(model_path, out, backend, dtype, calibrate)
    split = measured_split(data, split) if data is not None else split  # bad data fails before any work
    if calibrate or backend == "openvino":
        return quantize_calibrated(model_path, out, backend, calibration, data, split, methods, max_drop, force,
                                   per_channel, images, batch, log)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    result: dict = {"path": str(out)}
    with tempfile.TemporaryDirectory() as workdir:
        if backend == "onnxruntime":
            reference, candidate, info, result["ops"] = _quantize_to_onnx(model_path, tmp, Path(workdir), per_channel)
        else:
            reference, candidate, info = _quantize_checkpoint(model_path, tmp, dtype)
        try:
            if data is not None:
                guard = Guard(reference, info, *guard_source(info, data, split), max_drop, force, log)
                result.update(guard.check(guard.measure(candidate)[0], out))
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
    result.update(bytes=out.stat().st_size, written=True)
    return result


BACKENDS = {"onnxruntime": ".onnx", "torch": ".pt", "openvino": ".xml"}  # backend -> output suffix


def _check_request(model_path: str | Path, out: str | Path, backend: str, dtype: str, calibrate: bool = False) -> None:
    """Raises ValueError for a backend / dtype / input / output combination that cannot work."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown quantization backend {backend!r}; choose one of {list(BACKENDS)}")
    if calibrate and backend == "torch":
        raise ValueError("--calibrate (static INT8) goes with --backend onnxruntime or openvino; the torch backend "
                         "quantizes dynamically")
    if dtype not in ("int8", "fp16", "bf16"):
        raise ValueError(f"unknown dtype {dtype!r}; choose int8, fp16 or bf16")
    if backend != "torch" and dtype != "int8":
        raise ValueError(f"the {backend} backend writes INT8 models; for FP16/BF16 weights use --backend torch "
                         "(or build an FP16 TensorRT engine with `vitflow export --format tensorrt`)")
    if is_onnx(model_path) and backend == "torch":
        raise ValueError(f"{model_path} is an ONNX model; the torch backend needs a vitflow checkpoint")
    if is_openvino(model_path):
        raise ValueError(f"{model_path} is an OpenVINO IR; quantize takes the checkpoint (or vitflow .onnx) it came "
                         f"from: vitflow quantize RUN --backend openvino -o {Path(model_path).stem}.int8.xml")
    want = BACKENDS[backend]
    if Path(out).suffix.lower() != want:
        raise ValueError(f"output {out}: the {backend} backend writes a {want} file; name it *{want}")


def _quantize_to_onnx(model_path: str | Path, tmp: Path, workdir: Path, per_channel: bool):
    """INT8 ONNX of a vitflow ``.onnx`` or checkpoint (exported first, with the CPU fusions)
    written to ``tmp``; returns ``(reference, candidate, info, op counts)``."""
    info, state = model_info(model_path)
    reference, src = float_onnx(model_path, workdir, state)
    ops = quantize_onnx(src, tmp, per_channel)
    return reference, OnnxModel(tmp), info, ops


def _quantize_checkpoint(model_path: str | Path, tmp: Path, dtype: str):
    """An INT8 (dynamic) or FP16/BF16 checkpoint written to ``tmp``; returns ``(reference,
    candidate, info)``."""
    state = load_checkpoint(model_path)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is already quantized ({state['quantization']})")
    info, reference = ModelInfo.from_checkpoint(state), model_from_checkpoint(state)
    if dtype == "int8":
        candidate = quantize_torch(reference)
        new_state = {**inference_state(state), "model": candidate.state_dict(), "quantization": "dynamic-int8"}
    else:
        new_state = cast_checkpoint(state, dtype)
        dt = torch.float16 if dtype == "fp16" else torch.bfloat16
        candidate = CastModel(model_from_checkpoint(state).to(dt), dt)
    save_checkpoint(new_state, tmp)
    return reference, candidate, info
