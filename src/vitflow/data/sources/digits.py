"""The embedded default data: scikit-learn's handwritten digits (no download)."""

from __future__ import annotations

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.sources.base import DataError, TensorSource
from vitflow.data.sources.kind import SourceKind, Where


def digits_source() -> TensorSource:
    """scikit-learn's handwritten digits (UCI ML hand-written digits; Alpaydin & Kaynak 1998):
    1,797 real 8x8 grayscale scans of digits 0-9, shipped inside scikit-learn, as RGB ``uint8``
    ``(1797, 3, 8, 8)`` (16 grey levels scaled to 0..255). It has one split, ``train``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    gray = torch.from_numpy(np.round(d.images * (255.0 / 16.0))).to(torch.uint8)
    images = gray.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return TensorSource([str(c) for c in range(10)], d.target.astype(np.int64), images, "digits")


def _open(where: Where, split: str, classes: list[str] | None, cfg: DataConfig) -> TensorSource:
    if split != "train":
        raise DataError(f"the digits data has one split, 'train' (got {split!r}); "
                        "hold out images with slices such as 'train[80%:]'")
    return digits_source()


KIND = SourceKind("digits", "the embedded handwritten digits (scikit-learn's 8x8 scans; data.path unset)",
                  lambda where, cfg: ["train"], _open, needs_path=False)
