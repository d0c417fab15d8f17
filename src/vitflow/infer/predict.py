"""Prediction on image files, folders and tars with a trained checkpoint.

The preprocessing is the one saved in the checkpoint (decode with EXIF orientation, resize,
center crop, normalisation), exactly as in evaluation. An image that cannot be decoded does not
stop the others: its result carries an ``error`` naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from vitflow.data import normalize
from vitflow.data.decode import CorruptImageError, decode_image, is_image_name
from vitflow.data.sources import TarReader, is_hidden
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.runtime import configure_allocator
from vitflow.train.amp import resolve_device, resolve_precision
from vitflow.train.checkpoint import load_checkpoint, model_from_checkpoint


@dataclass
class ImageRef:
    """An image to predict: a display ``name`` and a callable returning its bytes."""

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
    """A model with its class names and preprocessing.

    ``predict(images)``: ``uint8 (B, 3, S, S)`` -> probabilities ``float32 (B, num_classes)``.
    """

    def __init__(self, model: torch.nn.Module, classes: list[str], pp: Preprocess, device: str = "auto",
                 precision: str = "fp32"):
        configure_allocator()
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device)
        self.model, self.classes, self.pp = model.to(self.device).eval(), classes, pp
        self.transform = eval_transform(pp)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "auto", precision: str = "fp32",
                        weights: str = "auto") -> "Predictor":
        """``weights``: ``auto`` (the EMA weights when the checkpoint has them), ``ema`` or ``raw``.
        Raises FileNotFoundError / ValueError for a missing, corrupt or incompatible checkpoint."""
        state = load_checkpoint(path)
        return cls(model_from_checkpoint(state, weights), list(state["classes"]),
                   Preprocess.from_dict(state["preprocess"]), device, precision)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        x = normalize(images.to(self.device), self.pp.mean, self.pp.std)
        with self.precision.autocast():
            logits = self.model(x)
        return logits.float().softmax(dim=-1).cpu()

    def predict_refs(self, refs: list[ImageRef], topk: int = 5, batch_size: int = 32) -> Iterator[dict]:
        """Yield per image ``{"path", "top": [{"class", "index", "prob"}, ...]}`` or
        ``{"path", "error"}`` when it cannot be read or decoded, in input order."""
        k = min(topk, len(self.classes))
        for start in range(0, len(refs), batch_size):
            chunk, tensors, results = refs[start:start + batch_size], [], []
            for ref in chunk:
                try:
                    tensors.append(self.transform(decode_image(ref.read(), ref.name)))
                    results.append({"path": ref.name})
                except (CorruptImageError, OSError) as e:
                    results.append({"path": ref.name, "error": str(e)})
            if tensors:
                probs = self.predict(torch.stack(tensors))
                top = probs.topk(k, dim=1)
                ok = iter(r for r in results if "error" not in r)
                for vals, idx in zip(top.values.tolist(), top.indices.tolist()):
                    next(ok)["top"] = [{"class": self.classes[i], "index": i, "prob": round(v, 6)}
                                       for v, i in zip(vals, idx)]
            yield from results
