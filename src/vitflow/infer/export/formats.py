"""Export a trained ViT for deployment: ONNX (dynamic batch, self-verifying, optionally fused),
TorchScript, ``torch.export`` ExportedProgram, and TensorRT engines built from the ONNX model.

Every export is verified: the exported artefact and the PyTorch model run the same real images
at two batch sizes from one export, and the largest absolute logit difference is reported (see
:func:`verify`).

The ONNX graph is exported from a *deployment copy* of the model (:func:`deployable`) whose
attention uses separate q/k/v projections and an explicit ``softmax(q k^T / sqrt(d)) v``. The
weights are the same (the fused qkv matrix split in three), the numbers agree to float rounding,
and the graph has the layout that ONNX Runtime's transformer optimizer (``--optimize``) and
TensorRT's attention fusion recognise. The model itself is never modified.
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.data import DataError
from vitflow.data.transforms import Preprocess
from vitflow.infer.calibration import checkpoint_split, images_from_files, sample_images
from vitflow.infer.export.deployable import deployable
from vitflow.infer.runtimes.onnx import (
    INPUT_NAME,
    OUTPUT_NAME,
    ModelInfo,
    OnnxModel,
    UnavailableError,
    is_onnx,
    onnx_opset,
    quiet_toolchain,
    require,
    set_metadata,
)
from vitflow.infer.runtimes.onnx_fusion import fusion_sizes, optimize_onnx
from vitflow.infer.runtimes.openvino import OpenVinoModel, convert_onnx, save_ir
from vitflow.infer.runtimes.tensorrt import TensorRTModel, build_tensorrt_engine, tensorrt_available
from vitflow.infer.tta import tta_for_export

log = logging.getLogger(__name__)

OPSET = 18  # the default, and the oldest: the dynamo exporter's own minimum (its conversion down to 17
MIN_OPSET = 18  # fails on the ViT graph's ReduceMean); newer ones are honoured where the exporter writes them
FORMATS = ("onnx", "torchscript", "exported-program", "tensorrt", "openvino")
EXTRA_FILE = "vitflow.json"  # ModelInfo inside TorchScript / ExportedProgram archives
_TWO_GB = 2 * 1024**3


def _sample_input(info: ModelInfo, batch: int = 2) -> torch.Tensor:
    s = info.preprocess.image_size
    return torch.randn(batch, 3, s, s)


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def export_onnx(model: nn.Module, path: str | Path, info: ModelInfo, opset: int = OPSET, as_is: bool = False) -> Path:
    """Export ``model`` to ONNX with a dynamic batch dimension and ``info`` in its metadata
    (its :func:`deployable` form; ``as_is``: the model as it is, e.g. timm's for a comparison).

    Uses the ``torch.export``-based exporter (``torch.onnx.export(dynamo=True)``, needs
    ``onnxscript``). Input ``pixel_values`` ``float32 (batch, 3, S, S)``, output ``logits``
    ``float32 (batch, num_classes)``; see :mod:`vitflow.infer.runtimes.onnx` for the metadata. Models
    over 2 GiB get their weights in an external ``<path>.data`` file (the protobuf limit).

    ``opset`` is honoured or refused, never silently changed: the file's opset is checked after
    the export (measured here: 18 to 25 export and verify).

    Raises:
        ValueError: ``opset`` below 18 or above the newest the installed ``onnx`` knows, or one the
            exporter wrote as another opset (the file is removed).
    """
    newest = require("onnx").defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise ValueError(f"--opset {opset} is not supported: vitflow exports opsets {MIN_OPSET} to {newest} (the "
                         f"exporter writes {MIN_OPSET} or newer; {newest} is the newest the installed onnx knows)")
    require("onnxscript")  # the torch.export-based exporter needs it
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).eval().float() if as_is else deployable(model)
    batch = torch.export.Dim("batch", min=1, max=65536)
    with quiet_toolchain(), torch.no_grad():
        torch.onnx.export(m, (_sample_input(info),), str(path), dynamo=True, opset_version=opset,
                          input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch},),
                          external_data=_param_bytes(m) > _TWO_GB * 0.9, verbose=False, report=False)
    written = onnx_opset(path)
    if written != opset:
        path.unlink(missing_ok=True)
        raise ValueError(f"the ONNX exporter could not write opset {opset} (it wrote {written}); use --opset {written}")
    set_metadata(path, info.to_metadata())
    return path


# ---------------------------------------------------------------------------------------------
# TorchScript and ExportedProgram


def export_torchscript(model: nn.Module, path: str | Path, info: ModelInfo) -> Path:
    """``torch.jit.trace`` of the model (batch-size independent: no data-dependent control flow)
    saved with ``info`` as the extra file ``vitflow.json``. Load with :func:`load_exported`."""
    m = deployable(model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, _sample_input(info), check_trace=False)
        torch.jit.save(traced, str(path), _extra_files={EXTRA_FILE: _info_json(info)})
    return Path(path)


def export_program(model: nn.Module, path: str | Path, info: ModelInfo) -> Path:
    """``torch.export.export`` with a dynamic batch dimension, saved by ``torch.export.save``
    (a ``.pt2`` archive) with ``info`` as the extra file ``vitflow.json``."""
    m = deployable(model)
    batch = torch.export.Dim("batch", min=1, max=65536)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(m, (_sample_input(info),), dynamic_shapes=({0: batch},))
        torch.export.save(ep, str(path), extra_files={EXTRA_FILE: _info_json(info)})
    return Path(path)


def _info_json(info: ModelInfo) -> str:
    return json.dumps({"classes": info.classes, "preprocess": info.preprocess.to_dict(),
                       "model_args": info.model_args, "task": info.task, "threshold": info.threshold})


def load_exported(path: str | Path, fmt: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], ModelInfo]:
    """Load an export written by this module: ``fmt`` one of ``onnx``, ``torchscript``,
    ``exported-program``. Returns ``(model, info)``; ``model(x)`` maps ``float32 (B, 3, S, S)``
    to logits ``(B, num_classes)``.

    Raises:
        FileNotFoundError: no such file. ValueError: unreadable or without vitflow metadata.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exported model not found: {path}")
    if fmt == "onnx":
        m = OnnxModel(path)
        return m, m.info()
    extra = {EXTRA_FILE: ""}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if fmt == "torchscript":
                m = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
            else:
                m = torch.export.load(str(path), extra_files=extra).module()
        d = json.loads(extra[EXTRA_FILE])
    except Exception as e:
        raise ValueError(f"cannot load {fmt} export {path}: {type(e).__name__}: {str(e)[:300]}") from None
    return m, ModelInfo(d["classes"], Preprocess.from_dict(d["preprocess"]), d["model_args"],
                        d.get("task", "multiclass"), d.get("threshold"))


# ---------------------------------------------------------------------------------------------
# verification


@dataclass
class Verification:
    """Result of :func:`verify`: ``max_abs_diff[batch_size]`` of the logits, the tolerance, and
    whether every batch size stayed within it."""

    max_abs_diff: dict[int, float]
    tolerance: float
    argmax_agree: dict[int, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(d <= self.tolerance for d in self.max_abs_diff.values())

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff.values())

    def summary(self) -> str:
        parts = ", ".join(f"batch {b}: {d:.2e}" for b, d in self.max_abs_diff.items())
        return f"max |logit diff| {parts} (tolerance {self.tolerance:g}) -> {'OK' if self.ok else 'FAILED'}"


@torch.no_grad()
def verify(reference: nn.Module, candidate: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
           batch_sizes: tuple[int, ...] = (1, 7), tolerance: float = 1e-4) -> Verification:
    """Compare ``candidate(x[:b])`` with ``reference(x[:b])`` for every ``b`` in ``batch_sizes``.

    Args:
        reference: the PyTorch model (run in eval mode, fp32, on the CPU).
        candidate: the exported model (ONNX Runtime session wrapper, TorchScript, ...).
        x: ``float32 (N, 3, S, S)`` normalised real images; repeated when ``N`` is smaller than a
            batch size.
    Returns:
        A :class:`Verification` with the max absolute logit difference per batch size.
    """
    reference = reference.eval()
    diffs, agree = {}, {}
    for b in batch_sizes:
        xb = x.repeat((b + len(x) - 1) // len(x), 1, 1, 1)[:b].contiguous()
        ref = reference(xb).float()
        out = torch.as_tensor(candidate(xb)).float().cpu()
        if out.shape != ref.shape:
            raise ValueError(f"exported model returned shape {tuple(out.shape)} for batch {b}, expected "
                             f"{tuple(ref.shape)}")
        diffs[b] = float((out - ref).abs().max())
        agree[b] = float((out.argmax(1) == ref.argmax(1)).float().mean())
    return Verification(diffs, tolerance, agree)


# ---------------------------------------------------------------------------------------------
# the `vitflow export` pipeline


def verification_images(state: dict, data: str | None, pp, n: int = 8) -> torch.Tensor:
    """``n`` real images for verifying an export: from ``data`` (image files, a folder or a tar)
    when given, else from the checkpoint's test split. ``float32 (n, 3, S, S)`` normalised.

    Raises:
        ValueError: no readable image there (the message says how to give some).
    """
    if data is not None:
        return images_from_files([data], pp, n)
    try:
        return sample_images(checkpoint_split(state), pp, n)
    except (DataError, ValueError) as e:
        raise ValueError(f"cannot find the checkpoint's test images to verify the export ({e}); "
                         "pass real images with --verify-data PATH") from None


def export_checkpoint(checkpoint: str | Path, out: str | Path, fmt: str = "onnx", optimize: bool = False,
                      target: str = "cpu", opset: int = OPSET, verify_data: str | None = None,
                      tolerance: float | None = None, batch_sizes: tuple[int, ...] = (1, 7), fp16: bool = True,
                      log: Callable[[str], None] = print, tta: str | None = None, batch: int | None = None) -> dict:
    """Export a checkpoint and verify the result against it on real images.

    Args:
        checkpoint: a checkpoint or run directory; for ``openvino`` also a vitflow ``.onnx``
            (converted as it is and verified against ONNX Runtime on ``verify_data``).
        fmt: ``onnx``, ``torchscript``, ``exported-program``, ``tensorrt`` (an FP16 engine when
            ``fp16``, built from an ONNX export written next to ``out``) or ``openvino`` (an IR
            ``.xml`` + ``.bin`` converted from the ONNX export, vitflow's metadata in its
            ``rt_info``; see :mod:`vitflow.infer.runtimes.openvino`).
        optimize: ONNX only: apply :func:`optimize_onnx` for ``target``.
        tolerance: max abs logit difference allowed (default 1e-4; 0.1 for FP16 TensorRT).
        tta: ONNX only: average the probabilities of these views in the graph (``flip``; see
            :func:`vitflow.infer.tta.tta_for_export`), verified against the PyTorch TTA.
        batch: OpenVINO: a fixed batch size (static shape), verified at that batch.
    Returns:
        ``{"format", "path", "bytes", "export_s", "max_abs_diff": {batch: diff}, "tolerance",
        "ok", "fused"}``.
    Raises:
        FileNotFoundError / ValueError: unreadable or incompatible checkpoint, bad format, no
        verification images, an op the target cannot convert. UnavailableError: TensorRT without
        tensorrt or a GPU; OpenVINO not installed.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    if fmt == "openvino" and optimize:
        raise ValueError("--optimize applies ONNX Runtime's fusions; OpenVINO fuses the graph itself: drop --optimize")
    if batch and fmt != "openvino":
        raise ValueError("--batch (a fixed batch size) goes with --format openvino")
    batch_sizes = (batch,) if batch else batch_sizes
    if is_onnx(checkpoint):
        return _onnx_to_openvino(checkpoint, out, fmt, verify_data, tolerance, batch_sizes, batch)
    if fmt == "tensorrt":  # fail before any work when the machine cannot do it
        reason = tensorrt_available()
        if reason:
            raise UnavailableError(f"cannot build a TensorRT engine: {reason}. Export ONNX here "
                                   f"(--format onnx) and build the engine on the GPU machine")
    state = load_checkpoint(checkpoint)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is an INT8 PyTorch checkpoint; export the float checkpoint "
                         "(and quantize the ONNX model with `vitflow quantize`)")
    model = model_from_checkpoint(state).float()
    info = ModelInfo.from_checkpoint(state)
    x = verification_images(state, verify_data, info.preprocess)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, model = time.perf_counter(), tta_for_export(model, tta, info, fmt)
    candidate, fused = _write(model, out, fmt, info, opset, optimize, target, fp16, log, batch)
    tol = tolerance if tolerance is not None else (0.1 if fmt == "tensorrt" and fp16 else 1e-4)
    return _report(fmt, out, time.perf_counter() - t0, verify(model, candidate, x, batch_sizes, tol), fused, len(x))


def _report(fmt: str, out: Path, export_s: float, check: Verification, fused: dict, images: int) -> dict:
    """The result dictionary of :func:`export_checkpoint`."""
    size = sum(f.stat().st_size for f in (out, out.with_suffix(".bin")) if fmt == "openvino" or f == out)
    return {"format": fmt, "path": str(out), "bytes": size, "export_s": round(export_s, 2),
            "max_abs_diff": check.max_abs_diff, "tolerance": check.tolerance, "ok": check.ok, "fused": fused,
            "images": images, "summary": check.summary()}


def _onnx_to_openvino(src: str | Path, out: str | Path, fmt: str, verify_data: str | None, tolerance: float | None,
                      batch_sizes: tuple[int, ...], batch: int | None) -> dict:
    """A vitflow ``.onnx`` converted to an OpenVINO IR and verified against ONNX Runtime."""
    if fmt != "openvino":
        raise ValueError(f"{src} is an ONNX model already: export a checkpoint, or convert it with --format openvino")
    if verify_data is None:
        raise ValueError(f"{src} carries no data path: give real images to verify the conversion with --verify-data PATH")
    t0, ir = time.perf_counter(), convert_onnx(src, batch)  # an op OpenVINO lacks: one line, before anything else
    reference = OnnxModel(src)
    info, out = reference.info(), save_ir(ir, out, reference.metadata)
    x = images_from_files([verify_data], info.preprocess)
    check = verify(reference, OpenVinoModel(out), x, batch_sizes, 1e-4 if tolerance is None else tolerance)
    return _report(fmt, out, time.perf_counter() - t0, check, {}, len(x))


def _write(model: nn.Module, out: Path, fmt: str, info: ModelInfo, opset: int, optimize: bool, target: str,
           fp16: bool, log: Callable[[str], None], batch: int | None = None
           ) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, int]]:
    """Write ``model`` to ``out`` in format ``fmt``; returns the export loaded back as a callable
    and the fused node counts (``optimize``)."""
    fused: dict[str, int] = {}
    if fmt == "openvino":
        with tempfile.TemporaryDirectory() as tmp:
            export_onnx(model, Path(tmp) / "model.onnx", info, opset)
            save_ir(convert_onnx(Path(tmp) / "model.onnx", batch), out, info.to_metadata())
        return OpenVinoModel(out), fused
    if fmt in ("onnx", "tensorrt"):
        onnx_path = out if fmt == "onnx" else out.with_suffix(".onnx")
        export_onnx(model, onnx_path, info, opset)
        if optimize:
            fused = optimize_onnx(onnx_path, onnx_path, target, *fusion_sizes(model))
    if fmt == "onnx":
        return OnnxModel(out), fused
    if fmt == "tensorrt":
        build = build_tensorrt_engine(onnx_path, out, fp16=fp16)
        log(f"TensorRT engine built in {build['build_s']:.1f} s ({'FP16' if fp16 else 'FP32'})")
        return TensorRTModel(out), fused
    (export_torchscript if fmt == "torchscript" else export_program)(model, out, info)
    return load_exported(out, fmt)[0], fused
