"""Prediction on image files, folders and tars with a trained checkpoint, an exported ONNX
model, an OpenVINO IR or a hub-style folder (:meth:`Predictor.load` is the one place that
tells them apart).

The preprocessing is the one saved in the checkpoint or in the ONNX file's metadata (decode with
EXIF orientation, resize, center crop, normalisation), exactly as in evaluation. An image that
cannot be decoded does not stop the others: its result carries an ``error`` naming the file.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.data import model_input
from vitflow.data.decode import CorruptImageError, decode_image, is_image_name
from vitflow.data.sources.readers import TarReader, is_hidden
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.infer.export.hub_folder import is_hub_folder, read_hub_folder
from vitflow.infer.runtimes.onnx import OnnxModel, RuntimeModel, is_onnx
from vitflow.infer.runtimes.openvino import OpenVinoModel, is_openvino, tuned_settings
from vitflow.infer.tta import parse_tta, tta_where, with_tta
from vitflow.runtime import configure_allocator, resolve_device, resolve_precision

log = logging.getLogger(__name__)


@dataclass
class ImageRef:
    """An image to predict: a display ``name`` and a callable returning its encoded bytes, or the
    image itself as ``uint8 (3, H, W)`` (an image held in Python: ``vitflow.load(...).predict``)."""

    name: str
    read: "callable"


def collect_images(inputs: Iterable[str | Path]) -> list[ImageRef]:
    """Expand files, folders (recursively, image extensions, hidden entries skipped) and
    ``.tar`` archives (image members) into a sorted list of :class:`ImageRef`.

    Raises:
        FileNotFoundError: an input path does not exist.
    """
    refs: list[ImageRef] = []
    for item in inputs:
        p = Path(item)
        if not p.exists():
            raise FileNotFoundError(f"no such image, folder or tar: {p}")
        if p.is_dir():
            for dirpath, dirnames, files in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
                for f in sorted(files):
                    if not is_hidden(f) and is_image_name(f):
                        refs.append(ImageRef(os.path.join(dirpath, f), _file_reader(os.path.join(dirpath, f))))
        elif p.suffix == ".tar":
            reader = TarReader(p)
            files, _ = reader.list()
            refs += [ImageRef(reader.describe(n), _tar_reader(reader, loc)) for n, loc in sorted(files.items())
                     if is_image_name(n)]
        else:
            refs.append(ImageRef(str(p), _file_reader(str(p))))
    return refs


def _file_reader(path: str):
    return lambda: Path(path).read_bytes()


def _tar_reader(reader: TarReader, loc):
    return lambda: reader.read(loc)


class Predictor:
    """A model with its class names and preprocessing: a PyTorch model or an exported model run
    by ONNX Runtime or OpenVINO (:class:`vitflow.infer.runtimes.onnx.RuntimeModel`).

    ``predict(images)``: ``uint8 (B, 3, S, S)`` -> probabilities ``float32 (B, num_classes)``: a
    softmax over the classes, or for a multi-label model (``task="multilabel"``) a sigmoid per
    class, each label predicted from ``threshold`` on.

    ``precision``: ``fp32``, or ``bf16`` / ``fp16`` to run a PyTorch model with its weights cast
    to that dtype (pure half-precision inference; ``fp16`` needs CUDA). ONNX models run in the
    precision they were exported / quantised in (``precision`` must be ``fp32``); an OpenVINO IR
    runs its float layers in ``fp32`` or ``bf16`` (:meth:`from_openvino`).

    Raises:
        ValueError: fp16 without CUDA, or a half precision asked of an ONNX / INT8 model.
    """

    def __init__(self, model: torch.nn.Module, classes: list[str], pp: Preprocess, device: str = "auto",
                 precision: str = "fp32", name: str = "model", task: str = "multiclass", threshold: float | None = None):
        configure_allocator()
        runtime = isinstance(model, RuntimeModel)
        self.device = torch.device("cpu") if runtime else resolve_device(device)
        self.dtype = resolve_precision(precision, self.device).dtype or torch.float32
        if self.dtype != torch.float32 and (runtime or _is_quantized(model)):
            raise ValueError(f"{name} runs in the precision it was exported or quantized in: use --precision fp32")
        self.model = model.eval() if runtime else model.to(self.device, self.dtype).eval()
        self.classes, self.pp, self.task = classes, pp, task
        self.threshold = 0.5 if threshold is None else threshold
        self.transform = eval_transform(pp)
        self.name, self.tta = name, "none"

    def set_tta(self, spec: str | None, flag: str = "--tta") -> None:
        """From now on, average the probabilities over test-time views (``spec``: ``flip``,
        ``flip,crops5``, ``scales=...``; :mod:`vitflow.infer.tta`). Raises ValueError for a bad spec
        or ``scales`` with an ONNX model (a fixed input size), naming the setting as ``flag`` does
        (``--tta``, or ``tta=`` from Python; :func:`~vitflow.infer.tta.tta_where`)."""
        parsed = parse_tta(spec, flag)
        if not parsed.enabled:
            return
        if self.tta != "none":
            raise ValueError(f"{self.name} already averages test-time views ({self.tta}, exported with --tta): "
                             f"predict without {flag.rstrip('=')}")
        if parsed.scales != (1.0,) and isinstance(self.model, RuntimeModel):
            raise ValueError(f"{tta_where(spec, flag)}: scales need a PyTorch checkpoint; {self.name} has a fixed "
                             "input size")
        self.model, self.tta = with_tta(self.model, parsed, self.task), str(parsed)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "auto", precision: str = "fp32",
                        weights: str = "auto") -> "Predictor":
        """``weights``: ``auto`` (the EMA weights when the checkpoint has them), ``ema`` or ``raw``.
        Raises FileNotFoundError / ValueError for a missing, corrupt or incompatible checkpoint."""
        state = load_checkpoint(path)
        return cls(model_from_checkpoint(state, weights), list(state["classes"]),
                   Preprocess.from_dict(state["preprocess"]), device, precision, state["path"],
                   state.get("task", "multiclass"), state.get("threshold"))

    @classmethod
    def from_onnx(cls, path: str | Path, threads: int | None = None) -> "Predictor":
        """An ONNX model exported by ``vitflow export`` (class names and preprocessing read from
        its metadata). Raises FileNotFoundError / ValueError naming the file."""
        return cls._from_runtime(OnnxModel(path, threads))

    @classmethod
    def from_openvino(cls, path: str | Path, precision: str = "fp32", threads: int | None = None,
                      static_shapes: bool = True) -> "Predictor":
        """An OpenVINO IR (``.xml`` + ``.bin``) written by ``vitflow export --format openvino`` or
        ``vitflow quantize --backend openvino``, compiled with vitflow's tuned settings
        (:func:`~vitflow.infer.runtimes.openvino.tuned_settings`: the throughput hint's streams for
        a batch, static shapes per batch size unless ``static_shapes`` is False), its float layers in
        ``precision``: ``fp32``, ``bf16``, or ``tuned`` (bf16 where the CPU has it natively, else
        fp32). The choice is logged. Raises FileNotFoundError / ValueError naming the file;
        UnavailableError without the ``openvino`` package."""
        settings = {**tuned_settings(), "static_shapes": static_shapes}
        if precision != "tuned":
            settings["precision"] = precision
        log.info("OpenVINO IR %s: %s float layers, %s hint, %s shapes (vitflow's tuned settings)", Path(path).name,
                 settings["precision"], settings["hint"], "static" if static_shapes else "dynamic")
        return cls._from_runtime(OpenVinoModel(path, threads=threads, **settings))

    @classmethod
    def _from_runtime(cls, model: RuntimeModel) -> "Predictor":
        path, info = model.path, model.info()
        predictor = cls(model, info.classes, info.preprocess, "cpu", "fp32", str(path), info.task, info.threshold)
        predictor.tta = info.tta  # an export with --tta averages its views in the graph
        return predictor

    @classmethod
    def from_hub_folder(cls, path: str | Path, device: str = "auto", precision: str = "fp32") -> "Predictor":
        """A hub-style model folder (``vitflow export --format hub``; see
        :mod:`vitflow.infer.export.hub_folder`). Raises FileNotFoundError / ValueError naming the folder,
        or ValueError for a folder whose head has no class names."""
        hub = read_hub_folder(path)
        if hub.classes is None:
            raise ValueError(f"{path}: its config.json names no classes (label_names) for its head; "
                             "`vitflow embed` takes it as a backbone")
        return cls(hub.model, hub.classes, hub.preprocess, device, precision, str(path), hub.task, hub.threshold)

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", precision: str = "fp32", weights: str = "auto"
             ) -> "Predictor":
        """:meth:`from_onnx` for a ``.onnx`` file, :meth:`from_openvino` for a ``.xml`` IR,
        :meth:`from_hub_folder` for a folder with a ``config.json``, else :meth:`from_checkpoint`
        (``weights`` as there)."""
        if is_hub_folder(path):
            return cls.from_hub_folder(path, device, precision)
        if is_openvino(path):
            return cls.from_openvino(path, precision)
        if is_onnx(path):
            if precision != "fp32":
                raise ValueError(f"{path} runs in the precision it was exported or quantized in: use --precision fp32")
            return cls.from_onnx(path)
        return cls.from_checkpoint(path, device, precision, weights)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        x = model_input(images, self.pp.mean, self.pp.std, self.device, self.dtype)
        logits = self.model(x).float()
        return (logits.sigmoid() if self.task == "multilabel" else logits.softmax(dim=-1)).cpu()

    def _decode(self, ref: ImageRef) -> torch.Tensor | str:
        """One image through the eval preprocessing, or its error text."""
        return decode_ref(ref, self.transform)

    def predict_refs(self, refs: list[ImageRef], topk: int = 5, batch_size: int = 32,
                     workers: int = 2) -> Iterator[dict]:
        """Yield per image ``{"path", "top": [{"class", "index", "prob"}, ...]}`` (the ``topk``
        likeliest classes; multi-label models add ``"labels"``: every class whose probability
        reaches the threshold, likeliest first) or ``{"path", "error"}`` when it cannot be read or
        decoded, in input order.

        Images are decoded by ``workers`` threads (libjpeg-turbo and the resize release the
        GIL), the next batch while the model runs on the current one.
        """
        for chunk, decoded in decoded_batches(refs, self.transform, batch_size, workers):
            results = [{"path": r.name, "error": d} if isinstance(d, str) else {"path": r.name}
                       for r, d in zip(chunk, decoded)]
            tensors = [d for d in decoded if not isinstance(d, str)]
            if tensors:
                ok = (r for r in results if "error" not in r)
                for r, answer in zip(ok, self.answers(self.predict(torch.stack(tensors)), topk)):
                    r.update(answer)
            yield from results

    def answers(self, probs: torch.Tensor, topk: int = 5) -> list[dict]:
        """Per row of ``probs`` (``float32 (B, num_classes)``, from :meth:`predict`)
        ``{"top": [{"class", "index", "prob"}, ...]}``: the ``topk`` likeliest classes (at most
        all), probabilities rounded to 6 decimals; multi-label models add ``"labels"``: every class
        whose probability reaches the threshold, likeliest first. The one formatting of results
        (``vitflow predict`` and ``vitflow serve``)."""
        top = probs.topk(min(topk, len(self.classes)), dim=1)
        out = []
        for p, vals, idx in zip(probs, top.values.tolist(), top.indices.tolist()):
            answer = {"top": self._entries(vals, idx)}
            if self.task == "multilabel":
                over = p.ge(self.threshold).nonzero().flatten()
                over = over[p[over].argsort(descending=True)]
                answer["labels"] = self._entries(p[over].tolist(), over.tolist())
            out.append(answer)
        return out

    def _entries(self, probs: list[float], indices: list[int]) -> list[dict]:
        return [{"class": self.classes[i], "index": i, "prob": round(v, 6)} for v, i in zip(probs, indices)]


def decode_ref(ref: ImageRef, transform) -> torch.Tensor | str:
    """``transform(decoded image)`` (``uint8 (3, S, S)``), or the error text naming the file."""
    try:
        data = ref.read()
        return transform(data if isinstance(data, torch.Tensor) else decode_image(data, ref.name))
    except (CorruptImageError, OSError) as e:
        return str(e)


def decoded_batches(refs: list[ImageRef], transform, batch_size: int = 32, workers: int = 2
                    ) -> Iterator[tuple[list[ImageRef], list[torch.Tensor | str]]]:
    """``(refs of a batch, their decoded images)`` in input order, ``batch_size`` at a time: each
    image ``uint8 (3, S, S)`` after ``transform`` (the eval preprocessing), or the error text
    (naming the file) of one that cannot be read or decoded.

    Images are decoded by ``workers`` threads (libjpeg-turbo and the resize release the GIL), the
    next batch while the caller works on the current one.
    """
    def decode(ref: ImageRef) -> torch.Tensor | str:
        return decode_ref(ref, transform)

    chunks = [refs[i:i + batch_size] for i in range(0, len(refs), batch_size)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        pending = [pool.map(decode, c) for c in chunks[:1]]
        for i, chunk in enumerate(chunks):
            decoded = list(pending.pop(0))
            if i + 1 < len(chunks):
                pending.append(pool.map(decode, chunks[i + 1]))
            yield chunk, decoded


def is_exported(path: str | Path) -> bool:
    """True for a model file an inference runtime runs (an ONNX model, an OpenVINO IR), as
    opposed to a checkpoint or a hub-style folder."""
    return is_onnx(path) or is_openvino(path)


def _is_quantized(model: torch.nn.Module) -> bool:
    return any("quantized" in type(m).__module__ for m in model.modules())
