"""The ``train`` section's checks that need the training layer's knowledge, run by
:func:`vitflow.config.build_config` before any work (the CLI passes them with the model and data
layers' checks)."""

from __future__ import annotations

from vitflow.config import TrainConfig
from vitflow.train.trackers import check_trackers


def check_config(t: TrainConfig) -> None:
    """Raises ConfigError (a TrackerError) when a tracker is switched on without its package."""
    check_trackers(t)
