"""The run's datasets, normalised as ``data.normalize`` says: with ``dataset``, the training split's
own mean and std (:func:`vitflow.data.stats.store.dataset_normalization`) go into the data section before
the splits are opened, so that the device pipeline, every evaluation and the checkpoint's
preprocessing (hence ``vitflow eval``, ``predict``, ``export`` and serving) use them. Within
:func:`shared_datasets` (a race's runs, one after another in one process) the splits of one data
section at one input size are opened, and decoded into RAM, once."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from vitflow.config import DataConfig
from vitflow.data import Datasets, open_datasets
from vitflow.data.stats.store import dataset_normalization
from vitflow.training.scale.distributed import DistEnv

_SHARED: dict[tuple[str, int], Datasets] | None = None  # inside shared_datasets(): (data section, size) -> splits


@contextlib.contextmanager
def shared_datasets() -> Iterator[None]:
    """Within: every :func:`open_run_datasets` of the same data section and input size returns the
    same :class:`~vitflow.data.Datasets` (for runs that follow one another in this process: the
    candidates of a race and its winner's continuation decode the images once)."""
    global _SHARED
    outer, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = outer


def open_run_datasets(d: DataConfig, image_size: int, dist: DistEnv, resumed: dict[str, Any] | None,
                      origins: dict[str, str] | None = None) -> Datasets:
    """:func:`~vitflow.data.open_datasets` of the data section ``d``, after ``data.normalize=dataset``
    has set ``d.mean`` / ``d.std`` to the training split's statistics (rank 0 reads or measures
    them; the other ranks receive rank 0's; ``origins``: the config's ``key_origins``, so that a
    mean / std the user set is compared with the measured one). A run resuming from the checkpoint state ``resumed``
    keeps the numbers it was trained with (that checkpoint's saved ``data.mean`` / ``data.std``),
    even if the data changed since.

    Raises:
        ConfigError, DataError, ValueError, OSError: see
        :func:`~vitflow.data.stats.store.dataset_normalization` and :func:`~vitflow.data.open_datasets`.
    """
    if d.normalize == "dataset" and resumed is not None:
        saved = resumed["config"]["data"]
        d.mean, d.std = tuple(saved["mean"]), tuple(saved["std"])
    elif d.normalize == "dataset":
        if dist.is_main:
            dataset_normalization(d, origins)
        d.mean, d.std = dist.broadcast((tuple(d.mean), tuple(d.std)))
    if _SHARED is None:
        return open_datasets(d, image_size)
    key = (repr(dataclasses.asdict(d)), image_size)
    if key not in _SHARED:
        _SHARED[key] = open_datasets(d, image_size)
    return _SHARED[key]
