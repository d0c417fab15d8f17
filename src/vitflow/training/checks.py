"""The configuration's checks that need a layer's knowledge, run by
:func:`vitflow.config.build_config` before any work: the ``train`` section's own
(:func:`check_config`) and :data:`CONFIG_CHECKS`, the bundle of every layer's that the command line
and the Python API (``vitflow.train``, ``vitflow.Config``) both pass."""

from __future__ import annotations

from vitflow.config import TrainConfig
from vitflow.data import check_config as check_data_config
from vitflow.models import check_config as check_model_config
from vitflow.training.track.selection import check_config as check_selection
from vitflow.training.track.trackers import check_trackers


def check_config(t: TrainConfig) -> None:
    """The metrics ``train.keep_best`` / ``train.early_stopping_metric`` name (the metric table's
    scores after a split prefix) and the trackers' packages.

    Raises:
        ConfigError: an unknown metric (naming the key, the known ones and an example);
            TrackerError: a tracker switched on without its package.
    """
    check_selection(t)
    check_trackers(t)


# the layers' config checks, run by every command (and every Python call) that builds a config
CONFIG_CHECKS = {"model": check_model_config, "data": check_data_config, "train": check_config}
