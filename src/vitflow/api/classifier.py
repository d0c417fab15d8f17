"""``vitflow.load(source)``: a trained model as a :class:`Classifier` that predicts on images held in
Python or on files, built on :class:`vitflow.infer.Predictor` (the loader and the preprocessing of
``vitflow predict``: the same numbers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitflow.api.display import shown
from vitflow.data.decode import as_image
from vitflow.data.transforms import Preprocess
from vitflow.infer import Predictor, collect_images
from vitflow.infer.features.backbone import Backbone, foreign_snapshot, load_plain_weights
from vitflow.infer.features.embed import embed_images
from vitflow.infer.predict import ImageRef
from vitflow.infer.tta import parse_tta
from vitflow.viz.attention import attention_maps


class Classifier:
    """A trained image classifier with its class names and evaluation preprocessing.

    Images are PIL images, ``uint8`` NumPy arrays ``(H, W, 3)`` or tensors ``(3, H, W)`` (a batch:
    ``(B, H, W, 3)`` / ``(B, 3, H, W)``), paths of image files, folders (their images, recursively)
    or ``.tar`` archives; one image or a list. Each goes through the model's eval preprocessing
    (:attr:`preprocess`: resize, center crop, normalisation; EXIF orientation applied to files and
    PIL images alike), exactly as ``vitflow predict`` does for files.

    Attributes:
        labels: the class names; class ``i`` is ``labels[i]``.
        preprocess: the eval preprocessing (:class:`vitflow.data.Preprocess`: ``image_size``,
            ``crop_pct``, ``interpolation``, ``mean``, ``std``).
        predictor: the underlying :class:`vitflow.infer.Predictor` (its ``model``: a
            ``torch.nn.Module`` or an ONNX Runtime session).
        source: what it was loaded from.
    """

    def __init__(self, predictor: Predictor, source: str):
        self.predictor, self.source = predictor, source

    @property
    def labels(self) -> list[str]:
        return list(self.predictor.classes)

    @property
    def preprocess(self) -> Preprocess:
        return self.predictor.pp

    @property
    def model(self):
        return self.predictor.model

    def __repr__(self) -> str:
        pp = self.preprocess
        return (f"vitflow.Classifier({self.source!r}: {len(self.labels)} classes, {pp.image_size}px input, "
                f"{self.predictor.device.type}{', TTA ' + self.predictor.tta if self.predictor.tta != 'none' else ''})")

    def predict(self, images: Any, topk: int = 5, batch_size: int = 32, workers: int = 2) -> dict | list[dict]:
        """The ``topk`` likeliest classes of each image.

        Args:
            images: one image or a list (class text), or a folder / tar of them.
            topk: classes per image (at most the class count).
            batch_size: images per forward pass; workers: threads decoding files.
        Returns:
            For each image ``{"image": its name (a path, or "images[i]"), "top": [{"class",
            "index", "prob"}, ...]}`` (probabilities: softmax, rounded to 6 decimals as ``vitflow
            predict --json`` writes them; multi-label models add ``"labels"``, every class over the
            threshold) or ``{"image", "error"}`` for a file that cannot be read; one dict for a
            single image, else a list in input order.
        Raises:
            TypeError: an image of another kind (a float tensor: pass ``uint8`` 0-255 pixels).
            FileNotFoundError: a path that does not exist.
        """
        refs, single = _refs(images)
        out = [{"image": r.pop("path"), **r} for r in self.predictor.predict_refs(refs, topk, batch_size, workers)]
        return out[0] if single else out

    @torch.no_grad()
    def probabilities(self, images: Any, batch_size: int = 32) -> torch.Tensor:
        """Class probabilities ``float32 (N, num_classes)`` of the images, unrounded (softmax; a
        sigmoid per class for multi-label models).

        Raises:
            ValueError: an image that cannot be read (naming it); TypeError as :meth:`predict`.
        """
        refs, _ = _refs(images)
        rows = []
        for start in range(0, len(refs), batch_size):
            pixels = [self._pixels(r) for r in refs[start:start + batch_size]]
            rows.append(self.predictor.predict(torch.stack(pixels)))
        return torch.cat(rows)

    def embed(self, images: Any, batch_size: int = 32) -> np.ndarray:
        """Pooled features ``float32 (N, D)`` of the images (the input of the classifier head:
        :func:`~vitflow.infer.features.embed.pooled_features`), as ``vitflow embed`` computes them.

        Raises:
            ValueError: an ONNX / INT8 file (features need the PyTorch model), or no image readable.
        """
        if not hasattr(self.model, "forward_features"):
            raise ValueError(f"{self.source}: features need the PyTorch model (a run, checkpoint or hub folder), "
                             "not an exported or quantized file")
        refs, _ = _refs(images)
        backbone = Backbone(self.model, self.preprocess, self.labels, self.source, type(self.model).__name__)
        feats, _ = embed_images(backbone, refs, batch_size, 2, str(self.predictor.device))
        return feats

    def attention_maps(self, image: Any, layer: int = -1, head_fusion: str = "mean"):
        """The attention of each head of block ``layer`` and the attention rollout over all blocks
        (Abnar & Zuidema 2020) on one image, as a matplotlib ``Figure`` (shown inline in Jupyter;
        ``fig.savefig(path)`` writes it), as ``vitflow attention`` draws them
        (:func:`vitflow.viz.attention.attention_maps`).

        Raises:
            ValueError: an ONNX / INT8 file, ``layer`` out of range, an unreadable image.
        """
        refs, _ = _refs(image)
        if len(refs) != 1:
            raise ValueError(f"attention_maps takes one image, got {len(refs)}")
        pixels = self._pixels(refs[0])
        return shown(attention_maps(self.predictor, pixels, layer, head_fusion, Path(refs[0].name).name)["figure"])

    def _pixels(self, ref: ImageRef) -> torch.Tensor:
        from vitflow.infer.predict import decode_ref

        pixels = decode_ref(ref, self.predictor.transform)
        if isinstance(pixels, str):
            raise ValueError(pixels)
        return pixels


def _refs(images: Any) -> tuple[list[ImageRef], bool]:
    """``(ImageRef per image, whether one image was given)``: files through
    :func:`vitflow.infer.collect_images` (folders and tars expanded), images held in Python as
    :func:`vitflow.data.decode.as_image` reads them."""
    single = not isinstance(images, (list, tuple)) and not _is_batch(images) and not (
        isinstance(images, (str, os.PathLike)) and (Path(images).is_dir() or str(images).endswith(".tar")))
    items = list(images) if isinstance(images, (list, tuple)) or _is_batch(images) else [images]
    refs: list[ImageRef] = []
    for i, item in enumerate(items):
        if isinstance(item, (str, os.PathLike)):
            refs += collect_images([item])
        else:
            name = f"images[{i}]"
            refs.append(ImageRef(name, lambda item=item, name=name: as_image(item, name)))
    return refs, single


def _is_batch(images: Any) -> bool:
    return isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4


def load(source: Any, device: str = "auto", precision: str = "fp32", weights: str = "auto",
         tta: str | None = None) -> Classifier:
    """A trained model as a :class:`Classifier`.

    Args:
        source: a run (:class:`~vitflow.api.run.Run` or its folder: its newest checkpoint, as
            ``vitflow predict RUN`` takes it), a checkpoint (``.pt``, INT8 ones included), an ONNX
            file (``vitflow export`` / ``vitflow quantize``: INT8 too), an OpenVINO IR (``.xml``:
            ``vitflow export --format openvino`` / ``quantize --backend openvino``), a hub-style folder
            (``vitflow export --format hub``, timm), or weights with a classifier head and label
            names (a snapshot folder or ``hf-hub:ORG/NAME``).
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda``; ONNX files and IRs run on the CPU.
        precision: ``fp32``, or ``bf16`` / ``fp16`` (PyTorch models only).
        weights: checkpoints: ``auto`` (the EMA weights when saved), ``ema`` or ``raw``.
        tta: test-time augmentation (``flip``, ``flip,crops5``; :mod:`vitflow.infer.tta`).
    Raises:
        FileNotFoundError: no such file or folder. ValueError: unreadable, corrupt or incompatible
        files (naming them), weights without a head or label names, a bad ``tta`` (one line:
        ``tta='flp': cannot read 'flp'; did you mean 'flip'? expected ...``).
    """
    check_tta(tta)  # a typo fails before any loading
    spec = os.fspath(getattr(source, "folder", source))
    if spec.startswith("hf-hub:") or (Path(spec).is_dir() and foreign_snapshot(Path(spec))):
        hub = load_plain_weights(spec, None, head=True)
        if not hub.classes:
            raise ValueError(f"{spec}: no label names for its head (a backbone): vitflow embed / eval --knn take it")
        predictor = Predictor(hub.model, hub.classes, hub.preprocess, device, precision, spec)
    else:
        predictor = Predictor.load(spec, device, precision, weights)
    predictor.set_tta(tta, TTA_FLAG)
    return Classifier(predictor, spec)


TTA_FLAG = "tta="  # how the Python face's messages name the setting (the command line's: --tta)


def check_tta(tta: Any) -> None:
    """Check that ``tta`` is a TTA spec (``None``, ``"flip"``, ``"flip,crops5"``, ...).

    Raises:
        ValueError: one line naming the value, the nearest valid spec and the choices
            (:func:`vitflow.infer.tta.parse_tta`).
    """
    parse_tta(tta, TTA_FLAG)

