"""The configuration a training run starts from, chosen as ``vitflow train`` chooses it and shared
with the Python API (``vitflow.train``): a resumed run's saved config (``train.resume``), the photo
plan for a ``data.path`` given without a recipe (:mod:`vitflow.training.plan.recipe`; with ``model.pretrained``
a planned fine-tune), the ``finetune`` preset
for pretrained weights given without one, else the preset / file / overrides as given."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from vitflow.config import Config, build_config
from vitflow.models import config_class
from vitflow.training.checks import CONFIG_CHECKS
from vitflow.training.plan.recipe import is_planned, planned_config
from vitflow.training.run.resume import resume_config

log = logging.getLogger("vitflow")


def default_preset(preset: str | None, config_file: str | None, overrides: Sequence[str]) -> str | None:
    """``preset``, or ``finetune`` for pretrained weights given without a recipe or config file."""
    if preset or config_file or not any(o.startswith("model.pretrained=") for o in overrides):
        return preset
    log.info("model.pretrained without --preset: using the finetune preset")
    return "finetune"


def training_config(preset: str | None, config_file: str | None, overrides: Sequence[str],
                    checks: Mapping[str, Any] = CONFIG_CHECKS) -> Config:
    """The validated config of a training run (module text) from a preset name, a YAML file and
    ``key=value`` overrides.

    Raises:
        ConfigError: a bad preset, file, key or value (naming it and where it was set);
            DataError: the photo plan cannot read ``data.path``; FileNotFoundError: a resume of a
            run that does not exist.
    """
    cfg = resume_config(preset, overrides, checks)  # a resume: the run's own config
    if cfg is not None:
        if preset or config_file:
            log.warning("--preset / --config ignored: a resumed run keeps its saved config (change keys with "
                        "key=value)")
        return cfg
    if is_planned(preset, config_file, list(overrides)):  # a photo folder (or a fine-tune on one): planned
        return planned_config(list(overrides), checks, preset)
    preset = default_preset(preset, config_file, overrides)
    return build_config(preset, config_file, overrides, checks=checks, model_config=config_class)
