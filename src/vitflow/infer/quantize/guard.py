"""The accuracy guard of quantisation: top-1 (multi-label models: mAP) of the float model and of
each quantised candidate on real images, and the refusal of a candidate that lost more than
allowed (``vitflow quantize --data ... --max-drop``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from vitflow.config import DataConfig
from vitflow.config.messages import MESSAGES
from vitflow.data import DataError, ImageSource, open_split
from vitflow.data.sources.dispatch import split_names
from vitflow.data.sources.labels import TEST_NAMES, VAL_NAMES
from vitflow.infer.calibration import accuracy, checkpoint_split
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.metrics import primary_metric

log = logging.getLogger(__name__)


class AccuracyDropError(RuntimeError):
    """The quantised model lost more top-1 than allowed; nothing was written."""


def guard_source(info: ModelInfo, data: str | None, split: str | None = None, state: dict | None = None
                 ) -> tuple[ImageSource | None, str]:
    """The images the guard measures on and how to name them: ``data [split]`` when ``data`` is
    given (``split`` ``None``: :func:`measured_split`), else (``state`` given) the checkpoint's own test split (its validation split when it
    has none), else ``(None, "")``: no guard.

    Raises:
        vitflow.data.DataError: ``data`` cannot be opened or has other classes.
    """
    if data is not None:
        split = measured_split(data, split)
        return open_split(data, split, "auto", classes=info.classes, cfg=DataConfig(task=info.task)), f"{data} [{split}]"
    if state is None:
        return None, ""
    try:
        return checkpoint_split(state), "the checkpoint's test data"
    except DataError:
        return None, ""


def measured_split(data: str, split: str | None) -> str:
    """The split of ``data`` the guard measures: ``split`` when given; else its test split, else its
    validation split; else, for a folder of class folders (a split folder itself, e.g.
    ``PHOTOS/test``), all its images (the folder kind's root split).

    Raises:
        DataError: no such split to choose (one line naming the folder to give instead).
    """
    if split:
        return split
    names = split_names(data)
    found = next((n for n in (*TEST_NAMES, *VAL_NAMES) if n in names), None)
    if found:
        return found
    if names == ["train"] and Path(data).is_dir() and not (Path(data) / "train").is_dir():
        log.info("--data %s: class folders at its root; measuring all its images", data)
        return "train"
    raise DataError(MESSAGES["quantize_no_split"].format(path=str(data).rstrip("/"), splits=", ".join(names)))


class Guard:
    """Measures the reference once, then each candidate; :meth:`check` refuses a drop over
    ``max_drop`` points (unless ``force``).

    Args:
        reference: the float model (PyTorch or a runtime model), fp32 on the CPU.
        source: the labelled images (see :func:`guard_source`).
    """

    def __init__(self, reference: torch.nn.Module, info: ModelInfo, source: ImageSource, label: str,
                 max_drop: float = 1.0, force: bool = False, log: Callable[[str], None] = print):
        self.info, self.source, self.max_drop, self.force = info, source, max_drop, force
        primary = primary_metric(info.task)  # top-1, or mAP
        self.figure, self.name = primary.name, primary.label
        log(f"measuring {self.name} on {len(source)} images of {label} ...")
        self.before, self.images = self.measure(reference)

    def measure(self, model: torch.nn.Module) -> tuple[float, int]:
        """``(top-1 or mAP as a fraction, images scored)`` of ``model`` on the guard's images."""
        r = accuracy(model, self.source, self.info.preprocess, threshold=self.info.threshold)
        return r[self.figure], r["images"]

    def drop(self, after: float) -> float:
        """Points lost from the reference's figure to ``after``."""
        return (self.before - after) * 100

    def check(self, after: float, out: str | Path, tried: str = "") -> dict:
        """The guard's figures for a candidate scoring ``after``.

        Raises:
            AccuracyDropError: the drop exceeds ``max_drop`` and not ``force`` (``out`` not written).
        """
        drop = self.drop(after)
        if drop > self.max_drop and not self.force:
            raise AccuracyDropError(
                f"{self.name} fell from {self.before:.2%} to {after:.2%} ({drop:.2f} points > --max-drop "
                f"{self.max_drop:g}{tried}); {out} NOT written (use --force to write it anyway)")
        return {f"{self.figure}_before": self.before, f"{self.figure}_after": after, "drop_points": round(drop, 3),
                "images": self.images, "max_drop": self.max_drop}
