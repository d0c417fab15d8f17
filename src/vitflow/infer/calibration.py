"""Real images for the inference tools: export verification, pruning calibration and the
accuracy checks of quantisation and pruning, all with the model's own eval preprocessing."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import torch

from vitflow.config import build_config
from vitflow.data import eval_loader, model_input, open_split
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.sources.base import ImageSource
from vitflow.data.sources.dispatch import scored_split
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.evaluation import evaluate, evaluate_multilabel
from vitflow.infer.predict import collect_images
from vitflow.models import config_class
from vitflow.runtime import resolve_precision


def checkpoint_split(state: dict, path: str | Path | None = None, split: str | None = None) -> ImageSource:
    """A split of the data a checkpoint was trained on (its config's ``data.path`` /
    ``data.source`` and its test split, else its validation split), or of ``path`` / ``split``
    when given, labelled with the checkpoint's classes.

    Raises:
        vitflow.data.DataError: the data cannot be found or does not match the classes.
    """
    data = build_config(base=state.get("config", {}), model_config=config_class).data
    if path is not None:
        data.path, data.source = str(path), "auto"
    if split is None:
        split = scored_split(data)[1]
    return open_split(data.path, split, data.source, classes=list(state["classes"]), cfg=data)


def _first_readable(loads: Iterable[Callable[[], torch.Tensor]], pp: Preprocess, n: int,
                    skip: tuple[type[Exception], ...], nothing: str) -> torch.Tensor:
    """The first ``n`` images of ``loads`` (each a call returning ``uint8 (3, H, W)``) that load
    without one of ``skip``, after the eval transform, normalised. Raises ValueError(``nothing``)
    when none does."""
    tf, images = eval_transform(pp), []
    for load in loads:
        if len(images) == n:
            break
        try:
            images.append(tf(load()))
        except skip:
            continue
    if not images:
        raise ValueError(nothing)
    return model_input(torch.stack(images), pp.mean, pp.std)


def sample_images(source: ImageSource, pp: Preprocess, n: int = 8) -> torch.Tensor:
    """The first ``n`` readable images of ``source`` after the eval transform, normalised:
    ``float32 (n', 3, S, S)`` with ``n' <= n``.

    Raises:
        ValueError: none of them can be decoded.
    """
    loads = (lambda i=i: source.load(i) for i in range(len(source)))
    return _first_readable(loads, pp, n, (CorruptImageError,), "no readable image for verification")


def images_from_files(paths: list[str], pp: Preprocess, n: int = 8) -> torch.Tensor:
    """Like :func:`sample_images` for image files, folders or tars (see
    :func:`vitflow.infer.predict.collect_images`)."""
    loads = (lambda ref=ref: decode_image(ref.read(), ref.name) for ref in collect_images(paths))
    return _first_readable(loads, pp, n, (CorruptImageError, OSError),
                           f"no readable image in {' '.join(map(str, paths))}")


def accuracy(model: torch.nn.Module, source: ImageSource, pp: Preprocess, batch_size: int = 256,
             num_workers: int = 2, threshold: float | None = None) -> dict[str, float]:
    """The figures of ``model`` (PyTorch or :class:`~vitflow.infer.onnx_model.OnnxModel`, fp32 on
    the CPU) over ``source``: top-1 / top-5 / loss with :func:`vitflow.evaluation.evaluate`, or for
    multi-hot labels (``uint8 (n, C)``) mAP / F1 at ``threshold`` with
    :func:`vitflow.evaluation.evaluate_multilabel`."""
    cpu = torch.device("cpu")
    loader = eval_loader(source, pp, batch_size, num_workers)
    if source.labels.ndim == 2:
        return evaluate_multilabel(model, loader, cpu, resolve_precision("fp32", cpu), pp, threshold=threshold)
    return evaluate(model, loader, cpu, resolve_precision("fp32", cpu), pp)
