"""ONNX Runtime as a drop-in model: an exported ``.onnx`` file behaves like the PyTorch model.

An ONNX file written by :func:`vitflow.infer.export.formats.export_onnx` carries everything prediction
needs in its ``metadata_props`` (string key/value pairs of the ONNX ``ModelProto``)::

    vitflow.format      "1"
    vitflow.classes     JSON list of class names, index i = logit i
    vitflow.preprocess  JSON Preprocess.to_dict(): image_size, crop_pct, interpolation, mean, std
    vitflow.model_args  JSON create_model arguments of the exported model (informational)
    vitflow.task        "multiclass" (softmax over the logits) or "multilabel" (a sigmoid per logit)
    vitflow.threshold   multilabel: the probability from which a label is predicted (JSON number)
    vitflow.tta         the test-time views averaged in the graph (``vitflow export --tta flip``) or "none";
                        with TTA the output is log(mean probability) (multi-class) or logit(mean
                        probability) (multi-label): softmax / sigmoid of it give the averaged probabilities

The graph has one input ``pixel_values`` ``float32 (batch, 3, S, S)`` (normalised with ``mean``
and ``std``; ``batch`` is dynamic) and one output ``logits`` ``float32 (batch, num_classes)``.
Keeping this in the file (not a sidecar) means the ``.onnx`` can be copied alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitflow.data.transforms import Preprocess

INPUT_NAME, OUTPUT_NAME = "pixel_values", "logits"
META_PREFIX = "vitflow."
META_FORMAT = "1"


class UnavailableError(RuntimeError):
    """A deployment target needs software or hardware this machine does not have (the message
    says what to install or where to run)."""


EXTRAS = {"export": "onnx, onnxruntime, onnxscript", "openvino": "openvino, nncf"}


def require(module: str, extra: str = "export"):
    """Import ``module`` (``onnx``, ``onnxruntime``, ``onnxscript``, ``openvino``, ``nncf``, ...)
    or raise :class:`UnavailableError` naming the optional extra that installs it
    (``vitflow[export]``, ``vitflow[openvino]``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UnavailableError(f"{module} is not installed: pip install 'vitflow[{extra}]' "
                               f"({EXTRAS[extra]})") from None


@dataclass
class ModelInfo:
    """What prediction needs beside the network: class names, preprocessing, model arguments, the
    task and (multi-label) the decision threshold chosen on the validation split."""

    classes: list[str]
    preprocess: Preprocess
    model_args: dict
    task: str = "multiclass"
    threshold: float | None = None
    tta: str = "none"  # test-time views averaged inside an exported graph (vitflow.infer.tta)

    def to_metadata(self) -> dict[str, str]:
        """The ``vitflow.*`` ONNX metadata entries (all values are strings)."""
        return {f"{META_PREFIX}format": META_FORMAT, f"{META_PREFIX}classes": json.dumps(self.classes),
                f"{META_PREFIX}preprocess": json.dumps(self.preprocess.to_dict()),
                f"{META_PREFIX}model_args": json.dumps(self.model_args), f"{META_PREFIX}task": self.task,
                f"{META_PREFIX}threshold": json.dumps(self.threshold), f"{META_PREFIX}tta": self.tta}

    @classmethod
    def from_metadata(cls, meta: dict[str, str], path: str | Path) -> "ModelInfo":
        """Raises ValueError naming ``path`` when the vitflow entries are missing or malformed."""
        try:
            return cls(json.loads(meta[f"{META_PREFIX}classes"]),
                       Preprocess.from_dict(json.loads(meta[f"{META_PREFIX}preprocess"])),
                       json.loads(meta.get(f"{META_PREFIX}model_args", "{}")),
                       meta.get(f"{META_PREFIX}task", "multiclass"),
                       json.loads(meta.get(f"{META_PREFIX}threshold", "null")), meta.get(f"{META_PREFIX}tta", "none"))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path} has no vitflow metadata (class names and preprocessing): export it with "
                             f"`vitflow export` ({type(e).__name__}: {e})") from None

    @classmethod
    def from_checkpoint(cls, state: dict) -> "ModelInfo":
        args = {k: v for k, v in state["model_args"].items() if k != "lora"}  # exports are merged: plain models
        return cls(list(state["classes"]), Preprocess.from_dict(state["preprocess"]), args,
                   state.get("task", "multiclass"), state.get("threshold"))


@contextlib.contextmanager
def quiet_toolchain():
    """Silence the INFO logging, warnings and prints of the ONNX tool chain (exporter, optimizer,
    quantizer) for the duration of the block; warnings and errors of vitflow's own code are not
    affected outside it."""
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def is_onnx(path: str | Path) -> bool:
    """True when ``path`` names an ONNX model (by its ``.onnx`` suffix)."""
    return Path(path).suffix.lower() == ".onnx"


def session_options(threads: int | None = None):
    """ONNX Runtime session options: all graph optimisations, ``threads`` intra-op threads (default
    ``torch.get_num_threads()``, so ONNX Runtime and PyTorch use the same cores), one inter-op thread."""
    ort = require("onnxruntime")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def open_session(path: str | Path, threads: int | None = None, providers: list[str] | None = None):
    """An ``onnxruntime.InferenceSession`` on the CPU (or ``providers``).

    Raises:
        FileNotFoundError: no such file. ValueError: truncated, corrupt or not an ONNX model
            (the message names the file).
    """
    ort = require("onnxruntime")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX model not found: {path}")
    try:
        return ort.InferenceSession(str(path), session_options(threads), providers=providers or ["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own InvalidProtobuf / Fail / InvalidGraph types
        raise ValueError(f"cannot load ONNX model {path} (truncated or corrupt?): {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from None


class RuntimeModel(torch.nn.Module):
    """An exported model run by an inference runtime (ONNX Runtime, OpenVINO) on the CPU, wrapped
    as a ``torch.nn.Module`` so that evaluation, prediction and benchmarks treat it like the
    PyTorch model. It runs in the precision it was exported / quantised in.

    ``forward(x)``: ``float32 (B, 3, S, S)`` (CPU or any device; copied to host) -> logits
    ``float32 (B, num_classes)`` on the CPU. Gradients are not supported. Subclasses give
    ``path``, :attr:`metadata` (the ``vitflow.*`` entries) and :meth:`run` (numpy in, numpy out).
    """

    path: str

    @property
    def metadata(self) -> dict[str, str]:
        raise NotImplementedError

    def info(self) -> ModelInfo:
        """The class names and preprocessing stored in the file (raises ValueError if absent)."""
        return ModelInfo.from_metadata(self.metadata, self.path)

    def run(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.run(np.ascontiguousarray(x.detach().float().cpu().numpy()))))


class OnnxModel(RuntimeModel):
    """An ONNX Runtime session as a :class:`RuntimeModel`.

    Raises (at construction): FileNotFoundError / ValueError, see :func:`open_session`.
    """

    def __init__(self, path: str | Path, threads: int | None = None):
        super().__init__()
        self.path = str(path)
        self.session = open_session(path, threads)
        self.input_name = self.session.get_inputs()[0].name

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.input_name: x})[0]


def copy_metadata(src: str | Path, dst: str | Path) -> None:
    """Copy the ``vitflow.*`` metadata of ONNX file ``src`` into ``dst`` (in place), e.g. after a
    tool (optimizer, quantizer) rewrote the graph without it."""
    onnx = require("onnx")
    meta = {p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props
            if p.key.startswith(META_PREFIX)}
    set_metadata(dst, meta)


def onnx_opset(path: str | Path) -> int:
    """The default-domain (``ai.onnx``) opset of the ONNX file at ``path``."""
    model = require("onnx").load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def set_metadata(path: str | Path, meta: dict[str, str]) -> None:
    """Set ``metadata_props`` entries of the ONNX file at ``path`` (in place; other entries kept)."""
    onnx = require("onnx")
    model = onnx.load(str(path), load_external_data=False)
    keep = [p for p in model.metadata_props if p.key not in meta]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(path))
