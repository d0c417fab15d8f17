"""The ``train`` section's checks that need the training layer's knowledge, run by
:func:`vitflow.config.build_config` before any work (the CLI passes them with the model and data
layers' checks)."""

from __future__ import annotations

from vitflow.config import TrainConfig
from vitflow.train.selection import check_config as check_selection
from vitflow.train.trackers import check_trackers


def check_config(t: TrainConfig) -> None:
    """The metrics ``train.keep_best`` / ``train.early_stopping_metric`` name (the metric table's
    scores after a split prefix) and the trackers' packages.

    Raises:
        ConfigError: an unknown metric (naming the key, the known ones and an example);
            TrackerError: a tracker switched on without its package.
    """
    check_selection(t)
    check_trackers(t)
