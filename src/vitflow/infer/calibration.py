"""Real images for the inference tools: export verification, pruning calibration and the
accuracy checks of quantisation and pruning, all with the model's own eval preprocessing."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from vitflow.config import build_config
from vitflow.data import DataError, eval_loader, model_input, open_split
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
                    skip: tuple[type[Exception], ...], nothing: str, sizes: list | None = None) -> torch.Tensor:
    """The first ``n`` images of ``loads`` (each a call returning ``uint8 (3, H, W)``) that load
    without one of ``skip``, after the eval transform, normalised; their decoded ``(H, W)`` are
    appended to ``sizes`` when given. Raises ValueError(``nothing``) when none loads."""
    tf, images = eval_transform(pp), []
    for load in loads:
        if len(images) == n:
            break
        try:
            image = load()
        except skip:
            continue
        images.append(tf(image))
        if sizes is not None:
            sizes.append(tuple(image.shape[-2:]))
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
    """The figures of ``model`` (PyTorch or :class:`~vitflow.infer.runtimes.onnx.OnnxModel`, fp32 on
    the CPU) over ``source``: top-1 / top-5 / loss with :func:`vitflow.evaluation.evaluate`, or for
    multi-hot labels (``uint8 (n, C)``) mAP / F1 at ``threshold`` with
    :func:`vitflow.evaluation.evaluate_multilabel`."""
    cpu = torch.device("cpu")
    loader = eval_loader(source, pp, batch_size, num_workers)
    if source.labels.ndim == 2:
        return evaluate_multilabel(model, loader, cpu, resolve_precision("fp32", cpu), pp, threshold=threshold)
    return evaluate(model, loader, cpu, resolve_precision("fp32", cpu), pp)


CALIBRATION_IMAGES = 300  # a few hundred: the ranges of static INT8 (ONNX Runtime, NNCF) settle well before that


def calibration_images(data: str | Path | None, pp: Preprocess, classes: list[str], state: dict | None = None,
                       n: int = CALIBRATION_IMAGES, split: str = "train", seed: int = 0) -> torch.Tensor:
    """Real images to calibrate static INT8 activation ranges on, through the model's eval
    transform: ``float32 (n', 3, S, S)`` normalised, ``n' <= n``, a seeded random draw over the
    split (so every class is represented).

    Args:
        data: ``None``: the training split of the data the checkpoint ``state`` was trained on
            (its config's ``data.path`` / ``data.train_split``); an image folder, tar, label file
            or dataset (its ``split``; a folder of images without class folders is taken whole);
            or a ``.npy`` array of model inputs ``float32 (N, 3, S, S)``, already normalised.
        classes: the model's classes; labelled calibration data must not have others.
    Raises:
        ValueError: one line naming ``data``: no images, classes that are not the model's, images
            under half the model's input size (their ranges would be those of upscaled pictures),
            a ``.npy`` of another shape, no ``data`` and no checkpoint data to fall back on.
    """
    size = pp.image_size
    if data is not None and str(data).lower().endswith(".npy"):
        return _npy_inputs(Path(data), size, n)
    label = f"calibration data {data}" if data is not None else "the checkpoint's training data"
    sizes: list[tuple[int, int]] = []
    source = _calibration_source(data, classes, state, split)
    if source is None:  # images without class folders
        loads = (lambda ref=ref: decode_image(ref.read(), ref.name) for ref in collect_images([data]))
    else:
        order = np.random.default_rng(seed).permutation(len(source))
        loads = (lambda i=int(i): source.load(i) for i in order)
    x = _first_readable(loads, pp, n, (CorruptImageError, OSError), f"{label}: no readable image in it", sizes)
    short = float(np.median([min(s) for s in sizes]))
    if short * 2 <= size:
        raise ValueError(f"{label}: its images are {short:.0f} px on the short side (median), the model takes "
                         f"{size}x{size}: ranges measured on pictures upscaled {size / short:.1f}x are not those of "
                         "real inputs; calibrate with images of the model's own data")
    return x


def _calibration_source(data: str | Path | None, classes: list[str], state: dict | None,
                        split: str) -> ImageSource | None:
    """The labelled split to draw calibration images from, or ``None`` for a folder or tar of
    images without class folders (see :func:`calibration_images` for the errors)."""
    if data is None:
        if state is None:
            raise ValueError("an exported model carries no training data path: give calibration images with "
                             "--calibrate DATA")
        cfg = build_config(base=state.get("config", {})).data
        try:
            return open_split(cfg.path, cfg.train_split, cfg.source, classes=list(classes), cfg=cfg)
        except DataError as e:
            raise ValueError(f"cannot open the checkpoint's training data for calibration ({e}); give calibration "
                             "images with --calibrate DATA") from None
    try:
        source = open_split(data, split, "auto")
    except DataError as e:
        if not Path(data).exists():
            raise ValueError(f"calibration data {data}: {e}") from None
        if not collect_images([data]):
            raise ValueError(f"calibration data {data}: no images in it (an empty folder?)") from None
        return None
    other = sorted(set(source.classes) - set(classes))
    if other:
        raise ValueError(f"calibration data {data} has {len(source.classes)} classes ({', '.join(other[:4])}"
                         f"{', ...' if len(other) > 4 else ''} are not the model's), the model {len(classes)}: "
                         "calibrate with images of the model's own data")
    return source


def _npy_inputs(path: Path, size: int, n: int) -> torch.Tensor:
    """The first ``n`` rows of a ``.npy`` of model inputs ``float32 (N, 3, size, size)``."""
    if not path.is_file():
        raise ValueError(f"calibration data {path}: no such file")
    x = np.load(path, mmap_mode="r")
    if x.ndim != 4 or tuple(x.shape[1:]) != (3, size, size) or x.dtype.kind != "f" or len(x) == 0:
        raise ValueError(f"calibration data {path} holds {x.dtype} {tuple(x.shape)}; the model takes "
                         f"float32 (N, 3, {size}, {size}) normalised inputs (N >= 1)")
    return torch.from_numpy(np.ascontiguousarray(x[:n], dtype=np.float32))
