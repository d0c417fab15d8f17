"""CIFAR-10 / CIFAR-100 python batches (https://www.cs.toronto.edu/~kriz/cifar.html) as an
in-memory source."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from vitflow.data.sources import DataError, TensorSource


def is_cifar_batches(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "batches.meta").is_file() or ((p / "meta").is_file() and (p / "train").is_file()))


def cifar_batches_source(path: str | Path, split: str) -> TensorSource:
    """CIFAR-10 (``data_batch_1..5``, ``test_batch``, ``batches.meta``) or CIFAR-100 (``train``,
    ``test``, ``meta``; fine labels) python batches as an in-memory ``uint8`` source.

    These files are Python pickles, the dataset's official format: open only copies you trust.

    Raises:
        DataError: unknown split or unreadable batch file.
    """
    root = Path(path)
    cifar10 = (root / "batches.meta").is_file()
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]} if cifar10 else \
        {"train": ["train"], "test": ["test"]}
    if split not in files:
        raise DataError(f"CIFAR batches in {root} have splits 'train' and 'test', not {split!r}")

    def load(name: str) -> dict:
        try:
            with open(root / name, "rb") as f:
                return pickle.load(f, encoding="bytes")
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise DataError(f"cannot read CIFAR batch {root / name}: {e}") from None

    meta = load("batches.meta" if cifar10 else "meta")
    classes = [c.decode() for c in meta[b"label_names" if cifar10 else b"fine_label_names"]]
    parts = [load(f) for f in files[split]]
    data = np.concatenate([p[b"data"] for p in parts]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([p[b"labels" if cifar10 else b"fine_labels"] for p in parts]).astype(np.int64)
    return TensorSource(classes, labels, torch.from_numpy(np.ascontiguousarray(data)), f"{root}/{split}")
