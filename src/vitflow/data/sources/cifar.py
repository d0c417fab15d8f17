"""CIFAR-10 / CIFAR-100 python batches (https://www.cs.toronto.edu/~kriz/cifar.html) as an
in-memory source.

The batches are Python pickles, the dataset's official format. They are read with a restricted
unpickler (:class:`BatchUnpickler`) that rebuilds only what the format holds (a dict of bytes
keys, lists, bytes, ints, strings and NumPy arrays): a crafted file that names any other callable
is refused before anything runs, and a malformed one gives one line naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import torch

from vitflow.data.sources.base import DataError, TensorSource
from vitflow.data.sources.kind import SourceKind, relabel

# the only globals a CIFAR batch pickle refers to: NumPy's array reconstruction, and (in batches
# re-pickled by Python 3 at protocol 2) the str -> bytes conversion of bytes objects
_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
            ("numpy._core.numeric", "_frombuffer"), ("_codecs", "encode")}


class BatchUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only NumPy's array reconstruction and ``_codecs.encode``
    (the globals CIFAR batches use); plain containers, bytes, numbers and strings need no globals.

    Raises:
        pickle.UnpicklingError: any other global (``os.system``, ``builtins.eval``, ...), named.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a CIFAR batch holds only arrays, lists and bytes")


def read_batch(path: Path) -> dict:
    """One batch file as a dict, through :class:`BatchUnpickler`.

    Raises:
        DataError: unreadable, refused (a global outside the format) or not a dict, naming the file.
    """
    try:
        obj = BatchUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, ImportError) as e:
        raise DataError(f"cannot read CIFAR batch {path}: {e}") from None
    if not isinstance(obj, dict):
        raise DataError(f"cannot read CIFAR batch {path}: a {type(obj).__name__}, not the format's dict")
    return obj


def _field(batch: dict, key: bytes, path: Path):
    if key not in batch:
        keys = ", ".join(repr(k) for k in list(batch)[:6])
        raise DataError(f"malformed CIFAR batch {path}: no {key!r} entry (it has {keys})")
    return batch[key]


def is_cifar_batches(path: str | Path) -> bool:
    """True for a folder of CIFAR-10 (``batches.meta``) or CIFAR-100 (``meta`` and ``train``) batches."""
    p = Path(path)
    return p.is_dir() and ((p / "batches.meta").is_file() or ((p / "meta").is_file() and (p / "train").is_file()))


def cifar_batches_source(path: str | Path, split: str) -> TensorSource:
    """CIFAR-10 (``data_batch_1..5``, ``test_batch``, ``batches.meta``) or CIFAR-100 (``train``,
    ``test``, ``meta``; fine labels) python batches as an in-memory ``uint8`` source.

    Raises:
        DataError: unknown split; an unreadable, refused or malformed batch file (named).
    """
    root = Path(path)
    cifar10 = (root / "batches.meta").is_file()
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]} if cifar10 else \
        {"train": ["train"], "test": ["test"]}
    if split not in files:
        raise DataError(f"CIFAR batches in {root} have splits 'train' and 'test', not {split!r}")

    meta_path = root / ("batches.meta" if cifar10 else "meta")
    names = _field(read_batch(meta_path), b"label_names" if cifar10 else b"fine_label_names", meta_path)
    if not isinstance(names, list) or not all(isinstance(c, (bytes, str)) for c in names):
        raise DataError(f"malformed CIFAR batch {meta_path}: the class names are not a list of strings")
    classes = [c.decode() if isinstance(c, bytes) else c for c in names]
    data, labels = [], []
    for name in files[split]:
        path = root / name
        batch = read_batch(path)
        pixels = np.asarray(_field(batch, b"data", path))
        ys = np.asarray(_field(batch, b"labels" if cifar10 else b"fine_labels", path))
        if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32 or len(ys) != len(pixels):
            raise DataError(f"malformed CIFAR batch {path}: data {pixels.dtype} {pixels.shape} with {len(ys)} labels, "
                            "expected uint8 (N, 3072) and N labels")
        if ys.size and (ys.min() < 0 or ys.max() >= len(classes)):
            raise DataError(f"malformed CIFAR batch {path}: labels outside 0..{len(classes) - 1}")
        data.append(pixels)
        labels.append(ys)
    images = np.ascontiguousarray(np.concatenate(data).reshape(-1, 3, 32, 32))
    return TensorSource(classes, np.concatenate(labels).astype(np.int64), torch.from_numpy(images), f"{root}/{split}")


KIND = SourceKind("cifar", "CIFAR-10 / CIFAR-100 python batches (a folder)", lambda where, cfg: ["train", "test"],
                  lambda where, split, classes, cfg: relabel(cifar_batches_source(where, split), classes),
                  detect=is_cifar_batches, what="CIFAR batches folder")
