"""The embedded default data: scikit-learn's handwritten digits (no download)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.sources.base import DataError, TensorSource
from vitflow.data.sources.kind import SourceKind, Where


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn's ``load_digits`` gives them: ``images`` float64 ``(1797, 8, 8)``
    (grey levels 0..16) and ``target`` int ``(1797,)``. Read straight from the file scikit-learn
    ships (``sklearn/datasets/data/digits.csv.gz``, located without importing scikit-learn, whose
    import costs a second of every ``vitflow train``'s start-up); ``load_digits`` itself where a
    scikit-learn release keeps the file elsewhere."""
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.images, d.target
    with gzip.open(csv, "rt") as f:
        rows = np.loadtxt(f, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)


def digits_source() -> TensorSource:
    """scikit-learn's handwritten digits (UCI ML hand-written digits; Alpaydin & Kaynak 1998):
    1,797 real 8x8 grayscale scans of digits 0-9, shipped inside scikit-learn, as RGB ``uint8``
    ``(1797, 3, 8, 8)`` (16 grey levels scaled to 0..255). It has one split, ``train``."""
    images, target = digits_arrays()
    gray = torch.from_numpy(np.round(images * (255.0 / 16.0))).to(torch.uint8)
    images = gray.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return TensorSource([str(c) for c in range(10)], target.astype(np.int64), images, "digits")


def _open(where: Where, split: str, classes: list[str] | None, cfg: DataConfig) -> TensorSource:
    if split != "train":
        raise DataError(f"the digits data has one split, 'train' (got {split!r}); "
                        "hold out images with slices such as 'train[80%:]'")
    return digits_source()


KIND = SourceKind("digits", "the embedded handwritten digits (scikit-learn's 8x8 scans; data.path unset)",
                  lambda where, cfg: ["train"], _open, needs_path=False)
