"""The configuration's checks that need a layer's knowledge, run by
:func:`vitflow.config.build_config` before any work: the ``train`` section's own
(:func:`check_config`) and :data:`CONFIG_CHECKS`, the bundle of every layer's that the command line
and the Python API (``vitflow.train``, ``vitflow.Config``) both pass."""

from __future__ import annotations

from vitflow.config import ConfigError, TrainConfig
from vitflow.data import check_config as check_data_config
from vitflow.models import check_config as check_model_config
from vitflow.models import list_models
from vitflow.training.track.selection import check_config as check_selection
from vitflow.training.track.trackers import check_trackers


def check_config(t: TrainConfig) -> None:
    """The metrics ``train.keep_best`` / ``train.early_stopping_metric`` name (the metric table's
    scores after a split prefix), the trackers' packages and the race's models.

    Raises:
        ConfigError: an unknown metric (naming the key, the known ones and an example);
            TrackerError: a tracker switched on without its package.
    """
    check_selection(t)
    check_trackers(t)
    check_race(t)


def race_names(race: str) -> list[str]:
    """The model names of ``train.race`` (comma-separated; ``[]`` for ``none``)."""
    return [] if race == "none" else [n.strip() for n in race.split(",")]


def check_race(t: TrainConfig) -> None:
    """``train.race``: ``none`` or at least two registered model names (``vitflow models``).

    Raises:
        ConfigError: one name, or a name that is not a model, naming it.
    """
    names = race_names(t.race)
    if not names:
        return
    unknown = [n for n in names if n not in set(list_models())]
    if unknown or len(set(names)) < 2:
        raise ConfigError(f"train.race={t.race}: " + (f"{', '.join(unknown)} is not a model (vitflow models)" if unknown
                          else "a race needs two model names or more (or none)"), "train.race")


# the layers' config checks, run by every command (and every Python call) that builds a config
CONFIG_CHECKS = {"model": check_model_config, "data": check_data_config, "train": check_config}
