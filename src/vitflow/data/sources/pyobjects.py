"""Python objects as data: a ``torch.utils.data.Dataset`` (map-style, ``(image, label)`` items), any
iterable of such pairs, or a pandas DataFrame of image paths and labels, handed to
``vitflow.train(data=..., val=..., test=...)``.

They join the pipeline as one more source kind, ``python``: the objects are registered in this
process under a key (``data.path=python:1:ImageFolder``) and each split opens as an
:class:`~vitflow.data.sources.base.ImageSource`, so the RAM cache, the batched path, device-side
augmentation, mixed precision, evaluation and split expressions (``data.val_split='train[90%:]'``)
apply to them unchanged.

- A **Dataset** (anything with ``__len__`` and ``__getitem__``): item ``i`` is ``(image, label)``
  (or a dict with ``image`` / ``label``); the image a PIL image, a ``uint8`` array or tensor, or a
  path (:func:`vitflow.data.decode.as_image`); the label a class index or a class name. The labels
  come from the dataset's ``targets`` (or ``labels``) when it has them (torchvision's convention),
  else from one pass over the items; the class names from its ``classes``, else the label values
  (names sorted, or indices ``0 .. K-1``).
- An **iterable** without random access (a generator, an ``IterableDataset``) is read once into a
  list.
- A **DataFrame**: the rows of a label file (:mod:`vitflow.data.sources.labelfile`: the same column
  names, split column, multi-label cells and checks); relative paths start at ``data.root`` or the
  working directory.

Loader worker processes (``data.num_workers``) receive a dataset by pickling where processes are
spawned (macOS, Windows, Python 3.14's forkserver): a dataset that does not pickle is refused for
``num_workers > 0`` everywhere, in one line naming its class (``auto`` loads it in-process), so that
code that runs here runs there.

An item that cannot be read (``__getitem__`` raises, or returns no ``(image, label)`` pair or an
image of another kind) stops the run with one :class:`DatasetItemError` line naming the dataset's
class, the index and the original error, in this process and in loader worker processes alike.

In the RAM cache (``data.max_in_memory``) a dataset is read once, at start-up, by
``data.num_workers`` processes (:meth:`DatasetSource.reader_processes`); epochs then take their
batches from that copy.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
from multiprocessing.pool import RemoteTraceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.decode import as_image
from vitflow.data.sources import labelfile
from vitflow.data.sources import labels as L
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.splits import parse_split

log = logging.getLogger(__name__)

PREFIX = "python:"
_REGISTRY: dict[str, dict[str, Any]] = {}  # key -> {split name: the user's object}
_OPENED: dict[tuple[str, str, tuple | None], ImageSource] = {}  # opened once: labels read once per split
_keys = itertools.count(1)


def register(splits: dict[str, Any]) -> str:
    """Register ``{split name: Dataset, iterable or DataFrame}`` in this process; returns the
    ``data.path`` that opens them (``python:N:CLASS``, e.g. ``python:1:ImageFolder``). Iterables are
    read into lists now.

    Raises:
        DataError: an object that is none of these (naming its split and type).
    """
    objects = {}
    for split, obj in splits.items():
        if obj is None:
            continue
        if not (_is_frame(obj) or _is_map_style(obj)):
            if not hasattr(obj, "__iter__") or isinstance(obj, (str, bytes, Path)):
                raise DataError(f"{split}: a {type(obj).__name__} is not data vitflow reads: give a path, a torch "
                                "Dataset of (image, label) items, an iterable of them, or a pandas DataFrame")
            obj = _Items(list(obj), type(obj).__name__)  # no random access: read once
        objects[split] = obj
    first = next(iter(objects.values()), None)
    key = f"{PREFIX}{next(_keys)}" + (f":{getattr(first, 'about', type(first).__name__)}" if first is not None else "")
    _REGISTRY[key] = objects
    return key


def describe(key: str) -> dict[str, str]:
    """``{split: the object's class name}`` registered under ``key`` (empty when unknown)."""
    return {split: getattr(obj, "about", type(obj).__name__) for split, obj in _REGISTRY.get(key, {}).items()}


def is_key(path: object) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def _is_frame(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "pandas" and hasattr(obj, "columns")


def _is_map_style(obj: Any) -> bool:
    return (hasattr(obj, "__len__") and hasattr(obj, "__getitem__") and not isinstance(obj, (str, bytes, dict))
            and not isinstance(obj, torch.utils.data.IterableDataset))


class _Items(list):
    """An iterable's items, read once (``about``: the iterable's class name)."""

    def __init__(self, items: list, about: str):
        super().__init__(items)
        self.about = about


def _objects(key: str) -> dict[str, Any]:
    if key not in _REGISTRY:
        raise DataError(f"data.path={key} names Python objects given to vitflow.train(data=...) in another process "
                        "(or session): pass the data again, e.g. run.evaluate(data=...), or give data.path=FOLDER")
    return _REGISTRY[key]


def split_names(where: str, cfg: DataConfig) -> list[str]:
    """The splits registered under ``where``, and those of a DataFrame's split column."""
    names: list[str] = []
    for split, obj in _objects(where).items():
        found = labelfile.table_splits(_table(obj), cfg.split_column) if _is_frame(obj) else [split]
        names += [n for n in found if n not in names]
    return names


def open_split(where: str, split: str, classes: list[str] | None, cfg: DataConfig) -> ImageSource:
    """One split (a split expression: ``train``, ``val``, ``train[:90%]``, ...) of the objects under
    ``where``, labelled with ``classes`` (``None``: the split's own).

    Raises:
        DataError: an unknown key or split, labels that do not fit ``classes``, an item that is
            not an ``(image, label)`` pair.
    """
    objects, sp = _objects(where), parse_split(split)
    name = L.canonical_split(sp.name, list(objects)) or sp.name
    frame = next((o for o in objects.values() if _is_frame(o)), None)
    if name not in objects and frame is None:
        raise DataError(f"split {sp.name!r} not found in {where} (splits: {', '.join(objects)}): give it as "
                        "vitflow.train(val=..., test=...), or slice the training data: val_split='train[90%:]'")
    cache_key = (where, name, None if classes is None else tuple(classes))
    if cache_key not in _OPENED:
        obj = objects.get(name, frame)
        _OPENED[cache_key] = _frame_source(obj, name, classes, cfg) if _is_frame(obj) else \
            DatasetSource.open(obj, classes)
    src = _OPENED[cache_key]
    return src.subset(sp.select(len(src)))


def _table(frame) -> labelfile.Table:
    columns = tuple(str(c) for c in frame.columns)
    rows = tuple(dict(zip(columns, values)) for values in frame.itertuples(index=False, name=None))
    return labelfile.Table(Path("DataFrame"), columns, rows, tuple(range(len(rows))), ())


def _frame_source(frame, split: str, classes: list[str] | None, cfg: DataConfig) -> ImageSource:
    table = _table(frame)
    positions = labelfile.rows_in_split(table, split, cfg.split_column) if split in labelfile.table_splits(
        table, cfg.split_column) or split == "train" else list(range(len(table.rows)))
    base = Path(cfg.root).expanduser() if cfg.root else Path.cwd()
    return labelfile.table_source(table, positions, split, classes, base, cfg.image_column, cfg.label_column,
                                  cfg.split_column, cfg.task == "multilabel", cfg.label_separator, cfg.classes)


class DatasetSource(ImageSource):
    """The items ``rows`` of a map-style dataset as an :class:`ImageSource` (see the module text).
    ``load(i)`` converts item ``rows[i]``'s image with :func:`~vitflow.data.decode.as_image` to
    ``uint8 (3, H, W)``; ``labels`` are ``int64 (n,)`` class indices."""

    def __init__(self, dataset, classes: list[str], labels: np.ndarray, rows: np.ndarray):
        self.dataset, self.classes, self.labels, self.rows = dataset, classes, labels, rows
        self.about = getattr(dataset, "about", type(dataset).__name__)
        self._problem: list[str | None] = []  # the pickling probe's answer, once

    @classmethod
    def open(cls, dataset, classes: list[str] | None = None) -> "DatasetSource":
        """All items of ``dataset``, labelled with ``classes`` (``None``: the dataset's own).

        Raises:
            DataError: an empty dataset, a label that is not a class of ``classes``, a bad item.
        """
        about = getattr(dataset, "about", type(dataset).__name__)
        if len(dataset) == 0:
            raise DataError(f"{about} is empty")
        raw = _raw_labels(dataset, about)
        _check_labels(raw, about, training=classes is None)
        names = [str(c) for c in getattr(dataset, "classes", None) or []]
        if all(isinstance(v, (int, np.integer)) for v in raw):  # class indices (into the dataset's names)
            own = names if len(names) > max(raw) else [str(i) for i in range(int(max(raw)) + 1)]
            by_name = classes is not None and names and list(classes) != own
            labels = np.array([list(classes).index(own[v]) if own[v] in classes else -1 for v in raw] if by_name
                              else raw, dtype=np.int64)
        else:  # class names
            own = L.sorted_classes({str(v) for v in raw})
            index = {c: i for i, c in enumerate(classes if classes is not None else own)}
            labels = np.array([index.get(str(v), -1) for v in raw], dtype=np.int64)
        classes = list(classes) if classes is not None else own
        if labels.min() < 0 or labels.max() >= len(classes):
            i = int(np.flatnonzero((labels < 0) | (labels >= len(classes)))[0])
            raise DataError(f"{about}[{i}]: label {raw[i]!r} is not one of the training classes "
                            f"({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''})")
        return cls(dataset, classes, labels, np.arange(len(labels)))

    def name(self, i: int) -> str:
        return f"{self.about}[{int(self.rows[i])}]"

    def load(self, i: int) -> torch.Tensor:
        """Item ``rows[i]``'s image as ``uint8 (3, H, W)``. Raises DatasetItemError (module text)."""
        row = int(self.rows[i])
        image, _ = _pair(_item(self.dataset, self.about, row), self.about, row)
        try:
            return as_image(image, self.name(i))
        except TypeError as e:
            raise DatasetItemError(str(e)) from None

    def reader_processes(self, num_workers: int | str) -> int:
        """The processes that read the dataset into the RAM cache: ``data.num_workers`` (0 or 1: this
        process), as a DataLoader's workers would call its ``__getitem__``; ``auto``: one per core,
        or this process when it does not pickle (forked readers would share its open files). Logged
        in one line, since epochs then read the RAM copy, not the dataset.

        Raises:
            DataError: ``num_workers > 0`` for a dataset that does not pickle (:meth:`worker_problem`).
        """
        if num_workers == "auto":
            n = 0 if self.worker_problem() else os.cpu_count() or 1
        elif int(num_workers) > 0 and (problem := self.worker_problem()):
            raise DataError(problem)
        else:
            n = int(num_workers)
        how = "in this process" if n <= 1 else f"in {n} worker processes"
        log.info("%s: reading its %d items into RAM once, %s (data.num_workers=%s); the epochs then take their "
                 "batches from RAM (data.max_in_memory=0 reads the dataset every epoch)", self.about, len(self),
                 how, num_workers)
        return n

    def subset(self, idx: np.ndarray) -> "DatasetSource":
        sub = DatasetSource(self.dataset, self.classes, self.labels[idx], self.rows[idx])
        sub._problem = self._problem
        return sub

    def worker_problem(self) -> str | None:
        """One line when the dataset does not pickle (see the module text), else ``None``."""
        if not self._problem:
            try:
                pickle.dump(self.dataset, _Discard(), protocol=pickle.HIGHEST_PROTOCOL)
                self._problem.append(None)
            except Exception as e:  # noqa: BLE001 - whatever pickling raises is the reason
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._problem.append(
                    f"{self.about} cannot go to loader worker processes: it does not pickle ({reason}); set "
                    "data.num_workers=0, or make it picklable (a class defined at module level whose attributes "
                    "pickle: open files and connections in __getitem__, not in __init__)")
        return self._problem[0]


class _Discard:
    """A file that forgets what is written (the pickling probe)."""

    def write(self, data) -> int:
        return len(data)


class DatasetItemError(DataError):
    """An item of a user's dataset that cannot be read: one line naming the dataset's class, the
    index and the error (``Photos[5]: __getitem__ raised KeyError: 'x'``), the original error as
    ``__cause__``.

    Raised in a loader worker process, it reaches this process through torch's ``Caught
    DatasetItemError in DataLoader worker process N`` text around the worker's traceback; the line
    is taken back out of it and the traceback kept as ``__cause__`` (a ``RemoteTraceback``, as a
    multiprocessing pool keeps it)."""

    def __init__(self, message: str):
        text = str(message)
        if text.startswith("Caught ") and "\nOriginal Traceback" in text:  # torch's re-raise in the main process
            self.__cause__ = RemoteTraceback(text.split("\nOriginal ", 1)[1])
            last = text.rstrip().splitlines()[-1]
            text = last.partition(f"{type(self).__name__}: ")[2] or last
        super().__init__(text)


def _item(dataset, about: str, i: int) -> Any:
    """``dataset[i]``; what its ``__getitem__`` raises becomes one :class:`DatasetItemError` line."""
    try:
        return dataset[i]
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises is the reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DatasetItemError(f"{about}[{i}]: __getitem__ raised {type(e).__name__}"
                               f"{': ' + first if first else ''}") from e


def _pair(item: Any, about: str, i: int) -> tuple[Any, Any]:
    if isinstance(item, dict) and "image" in item:
        return item["image"], item.get("label", item.get("labels"))
    if isinstance(item, (tuple, list)) and len(item) >= 2:
        return item[0], item[1]
    raise DatasetItemError(f"{about}[{i}] is a {type(item).__name__}: vitflow reads (image, label) items")


def _raw_labels(dataset, about: str) -> list:
    """Each item's label: the dataset's ``targets`` / ``labels`` when it has one per item, else
    read item by item (logged: it decodes every image once)."""
    for attr in ("targets", "labels"):
        values = getattr(dataset, attr, None)
        if values is not None and not callable(values) and len(values) == len(dataset):
            values = values.tolist() if isinstance(values, (np.ndarray, torch.Tensor)) else list(values)
            return [_plain(v) for v in values]
    log.info("%s has no targets attribute: reading its %d labels item by item", about, len(dataset))
    return [_plain(_pair(_item(dataset, about, i), about, i)[1]) for i in range(len(dataset))]


def _check_labels(raw: list, about: str, training: bool) -> None:
    """Refuse labels that would train a wrong model silently: a label that is neither a class index
    (``int`` >= 0) nor a class name (``str``), indices mixed with names, and (for the training
    split) fewer than 2 classes. Raises DataError naming the item and its label."""
    for i, v in enumerate(raw):
        if isinstance(v, str) or (isinstance(v, int) and v >= 0):
            continue
        raise DataError(f"{about}[{i}]: label {v!r} ({type(v).__name__}) is neither a class index (an int >= 0) "
                        "nor a class name (a str)")
    kinds = [isinstance(v, str) for v in raw]
    if any(kinds) and not all(kinds):
        i, j = kinds.index(False), kinds.index(True)
        raise DataError(f"{about} mixes class indices and class names: {about}[{i}] is {raw[i]!r}, "
                        f"{about}[{j}] is {raw[j]!r}; use one or the other")
    if training and len(set(raw)) < 2:
        raise DataError(f"{about}: every item has the label {raw[0]!r}; a classifier needs at least 2 classes")


def _plain(label: Any) -> Any:
    if isinstance(label, torch.Tensor) and label.numel() == 1:
        return int(label.item())
    return int(label) if isinstance(label, (bool, np.integer)) else label


KIND = SourceKind("python", "Python objects given to vitflow.train(data=...): a torch Dataset of (image, label) "
                  "items, an iterable of them or a pandas DataFrame (data.path=python:N:CLASS, set by vitflow.train)",
                  split_names, open_split, detect=is_key, spec=True, what="key of Python objects (python:N:CLASS)")
