"""OpenVINO as a deployment backend: IR files (``model.xml`` + ``model.bin``) written from
vitflow's verified ONNX export, INT8 by NNCF post-training quantization, and
:class:`OpenVinoModel`, the IR run by OpenVINO's CPU plugin as a module that prediction,
evaluation and benchmarks use like the PyTorch model.

An IR written here carries the ``vitflow.*`` entries of the ONNX metadata (class names,
preprocessing, model arguments, task; see :mod:`vitflow.infer.runtimes.onnx`) in its ``rt_info``
under the key ``vitflow``, so ``model.xml`` (with its ``.bin``) needs nothing else.
``pip install 'vitflow[openvino]'`` installs ``openvino`` and ``nncf``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from vitflow.infer.runtimes.onnx import META_PREFIX, RuntimeModel, quiet_toolchain, require
from vitflow.runtime import cpu_bf16_supported

IR_SUFFIX = ".xml"
RT_KEY = "vitflow"  # rt_info section holding the vitflow.* metadata (without the prefix)
PRECISIONS = {"fp32": "f32", "bf16": "bf16"}  # vitflow precision -> INFERENCE_PRECISION_HINT
HINTS = ("latency", "throughput")


def tuned_settings() -> dict:
    """vitflow's OpenVINO settings for this machine: bf16 float layers where oneDNN has native
    bf16 (AVX512-BF16 / AMX), else fp32; the throughput hint (a batch split over the streams)
    with static shapes per batch size. Measured with ``vitflow bench infer``
    (``openvino_int8_tuned``): see the deployment guide's table. ``vitflow serve`` runs an IR
    with them."""
    return {"precision": "bf16" if cpu_bf16_supported() else "fp32", "hint": "throughput", "static_shapes": True}


def openvino():
    """The ``openvino`` module, or :class:`~vitflow.infer.runtimes.onnx.UnavailableError` naming
    the ``vitflow[openvino]`` extra."""
    return require("openvino", "openvino")


def is_openvino(path: str | Path) -> bool:
    """True when ``path`` names an OpenVINO IR (by its ``.xml`` suffix)."""
    return Path(path).suffix.lower() == IR_SUFFIX


def convert_onnx(onnx_path: str | Path, batch: int | None = None):
    """An ``openvino.Model`` of an ONNX file (``openvino.convert_model``), its batch fixed to
    ``batch`` when given (a static shape lets the CPU plugin plan memory once).

    Raises:
        ValueError: an op OpenVINO cannot convert (one line naming the file and the ops).
    """
    ov = openvino()
    try:
        with quiet_toolchain():
            model = ov.convert_model(str(onnx_path))
    except Exception as e:  # OpConversionFailure: a long report; keep the ops it names
        ops = re.findall(r"No conversion rule found for operations: (.*)", str(e))
        what = f"no conversion for {ops[0].strip()}" if ops else f"{type(e).__name__}: {str(e).strip()[:200]}"
        raise ValueError(f"OpenVINO {ov.__version__.split('-')[0]} cannot convert {onnx_path}: {what}; convert "
                         "vitflow's plain export (vitflow export RUN --format openvino)") from None
    if batch:
        model.reshape({0: [batch, *[d.get_length() for d in list(model.input(0).get_partial_shape())[1:]]]})
    return model


def set_ir_metadata(model, meta: dict[str, str]) -> None:
    """Store the ``vitflow.*`` entries ``meta`` in ``model``'s ``rt_info`` (section ``vitflow``)."""
    for key, value in meta.items():
        model.set_rt_info(value, [RT_KEY, key.removeprefix(META_PREFIX)])


def ir_metadata(model) -> dict[str, str]:
    """The ``vitflow.*`` entries of an ``openvino.Model``'s ``rt_info`` (empty when it has none)."""
    if not model.has_rt_info([RT_KEY]):
        return {}
    section = model.get_rt_info([RT_KEY])
    return {f"{META_PREFIX}{k}": str(v.astype(str)) for k, v in section.astype(dict).items()}


def save_ir(model, path: str | Path, meta: dict[str, str]) -> Path:
    """Write ``model`` as ``path`` (``.xml``) + its ``.bin`` with ``meta`` in its ``rt_info``;
    weights stay float32 (no FP16 compression: the IR computes what the export verified).

    Raises:
        ValueError: ``path`` does not end in ``.xml``.
    """
    path = Path(path)
    if not is_openvino(path):
        raise ValueError(f"output {path}: an OpenVINO IR is written as a .xml file (its weights beside it as .bin)")
    path.parent.mkdir(parents=True, exist_ok=True)
    set_ir_metadata(model, meta)
    openvino().save_model(model, str(path), compress_to_fp16=False)
    return path


def read_ir(path: str | Path):
    """``openvino.Core().read_model`` of ``path``.

    Raises:
        FileNotFoundError: no ``.xml`` or no ``.bin`` beside it. ValueError: not a readable IR.
    """
    path = Path(path)
    for f in (path, path.with_suffix(".bin")):
        if not f.is_file():
            raise FileNotFoundError(f"OpenVINO IR file not found: {f}")
    try:
        return openvino().Core().read_model(str(path))
    except Exception as e:
        raise ValueError(f"cannot read OpenVINO IR {path} (truncated or corrupt?): {type(e).__name__}: "
                         f"{str(e).strip()[:200]}") from None


class OpenVinoModel(RuntimeModel):
    """An OpenVINO IR (a file or an ``openvino.Model``) compiled for the CPU, as a
    :class:`~vitflow.infer.runtimes.onnx.RuntimeModel`: ``float32 (B, 3, S, S)`` -> logits
    ``float32 (B, num_classes)``. An IR with a fixed batch size ``N`` takes any batch: it is cut
    into batches of ``N``, the last one zero-padded.

    Args:
        model: a ``.xml`` path or an ``openvino.Model``.
        precision: ``fp32`` (exact: ``INFERENCE_PRECISION_HINT=f32``), ``bf16`` or ``auto``
            (OpenVINO's default: bf16 on CPUs with AMX / AVX512-BF16). The INT8 layers of an NNCF
            model run in INT8 either way.
        threads: ``INFERENCE_NUM_THREADS`` (default ``torch.get_num_threads()``).
        hint: ``latency`` (one stream, all threads on each request: the right one for one caller)
            or ``throughput`` (several streams, each on its own cores: a batch of at least two
            images a stream is split over them and its parts run in parallel; a smaller batch,
            which one stream would run on its share of the cores, runs on a latency-hint copy
            with all of them).
        static_shapes: compile a static-shape copy for every (sub-)batch size seen (the batch is
            known in a deployment): OpenVINO plans memory and picks kernels once for that shape.
    Raises:
        FileNotFoundError / ValueError: see :func:`read_ir`; ValueError for an unknown precision
        or hint. UnavailableError: no ``openvino`` package.
    """

    def __init__(self, model, precision: str = "fp32", threads: int | None = None, hint: str = "latency",
                 static_shapes: bool = False, name: str | None = None):
        super().__init__()
        if precision not in (*PRECISIONS, "auto"):
            raise ValueError(f"OpenVINO runs an IR in {', '.join(PRECISIONS)} or auto, not {precision}")
        if hint not in HINTS:
            raise ValueError(f"unknown OpenVINO performance hint {hint!r}; choose one of {list(HINTS)}")
        self.path = str(model) if isinstance(model, (str, Path)) else (name or "<openvino model>")
        self.model = read_ir(model) if isinstance(model, (str, Path)) else model
        self.precision, self.hint, self.static_shapes = precision, hint, static_shapes
        self.config = {"PERFORMANCE_HINT": hint.upper(), "INFERENCE_NUM_THREADS": threads or torch.get_num_threads()}
        if precision != "auto":
            self.config["INFERENCE_PRECISION_HINT"] = PRECISIONS[precision]
        first = openvino().Core().compile_model(self.model, "CPU", self.config)
        self.compiled = {(None, hint): first}  # (static batch or None, hint) -> compiled model
        self.streams = int(first.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")) if hint == "throughput" else 1
        shape = self.model.input(0).get_partial_shape()
        self.fixed_batch = shape[0].get_length() if shape[0].is_static else None
        self.item_shape = [d.get_length() for d in list(shape)[1:]]  # (3, S, S): static in vitflow's exports
        self.requests: dict[tuple[int, int, str], object] = {}

    @property
    def metadata(self) -> dict[str, str]:
        return ir_metadata(self.model)

    def _request(self, n: int, i: int, hint: str):
        """The infer request of stream ``i`` for batches of ``n``, compiled with ``hint``."""
        if (n, i, hint) not in self.requests:
            key = (n if self.static_shapes and self.fixed_batch is None else None, hint)
            if key not in self.compiled:
                model = self.model
                if key[0] is not None:
                    model = self.model.clone()
                    model.reshape({0: [n, *self.item_shape]})
                config = {**self.config, "PERFORMANCE_HINT": hint.upper()}
                self.compiled[key] = openvino().Core().compile_model(model, "CPU", config)
            self.requests[(n, i, hint)] = self.compiled[key].create_infer_request()
        return self.requests[(n, i, hint)]

    def run(self, x: np.ndarray) -> np.ndarray:
        if self.fixed_batch is not None and len(x) != self.fixed_batch:
            n = self.fixed_batch
            chunks = [x[i:i + n] for i in range(0, len(x), n)]
            pad = [np.concatenate([c, np.zeros((n - len(c), *c.shape[1:]), c.dtype)]) for c in chunks]
            return np.concatenate([self.run(c)[:len(chunk)] for c, chunk in zip(pad, chunks)])
        split = self.streams > 1 and len(x) >= 2 * self.streams and self.fixed_batch is None
        parts = np.array_split(x, self.streams) if split else [x]
        hint = self.hint if split or self.streams == 1 else "latency"  # one part: all the threads on it
        requests = [self._request(len(p), i, hint) for i, p in enumerate(parts)]
        for request, part in zip(requests, parts):
            request.start_async({0: np.ascontiguousarray(part)})
        for request in requests:
            request.wait()
        return np.concatenate([r.get_output_tensor(0).data for r in requests])


def nncf_quantize(model, images: torch.Tensor, batch: int = 8, fast_bias_correction: bool = True):
    """INT8 of an ``openvino.Model`` by NNCF post-training quantization (``nncf.quantize`` with
    ``model_type=TRANSFORMER``: symmetric per-channel INT8 weights, activation ranges from
    ``images``, SmoothQuant-style scale migration, bias correction; softmax, LayerNorm and GELU
    stay in float). ``images``: ``float32 (N, 3, S, S)`` normalised real images, ``batch`` at a
    time. Returns a new ``openvino.Model`` (Nagel et al. 2021, "A White Paper on Neural Network
    Quantization"; NNCF's ``quantize``)."""
    nncf = require("nncf", "openvino")
    batches = [np.ascontiguousarray(images[i:i + batch].numpy()) for i in range(0, len(images), batch)]
    with quiet_toolchain():
        return nncf.quantize(model, nncf.Dataset(batches), model_type=nncf.ModelType.TRANSFORMER,
                             subset_size=len(batches), fast_bias_correction=fast_bias_correction)

