"""The run's datasets, normalised as ``data.normalize`` says: with ``dataset``, the training split's
own mean and std (:func:`vitflow.data.stats.store.dataset_normalization`) go into the data section before
the splits are opened, so that the device pipeline, every evaluation and the checkpoint's
preprocessing (hence ``vitflow eval``, ``predict``, ``export`` and serving) use them."""

from __future__ import annotations

from typing import Any

from vitflow.config import DataConfig
from vitflow.data import Datasets, open_datasets
from vitflow.data.stats.store import dataset_normalization
from vitflow.training.scale.distributed import DistEnv


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
    return open_datasets(d, image_size)
