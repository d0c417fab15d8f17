"""Configuration: the typed tree (:mod:`.schema`) and how it is built from presets, YAML files
and ``key=value`` overrides (:mod:`.build`). Pure data: imports no other part of vitflow."""

from vitflow.config.build import (
                                  RENAMED,
                                  all_keys,
                                  build_config,
                                  flatten,
                                  list_presets,
                                  parse_override,
                                  preset_tree,
                                  set_key,
                                  to_yaml,
)
from vitflow.config.checks import ConfigError
from vitflow.config.data_schema import IMAGENET_MEAN, IMAGENET_STD, DataConfig
from vitflow.config.schema import (
                                  DEFAULT_PRESET,
                                  Config,
                                  DistillConfig,
                                  FinetuneConfig,
                                  ModelConfig,
                                  OptimConfig,
                                  TrainConfig,
                                  parse_duration,
)

__all__ = ["DEFAULT_PRESET", "IMAGENET_MEAN", "IMAGENET_STD", "RENAMED", "Config", "ConfigError", "DataConfig",
           "DistillConfig", "FinetuneConfig", "ModelConfig", "OptimConfig", "TrainConfig", "all_keys", "build_config", "flatten",
           "list_presets", "parse_duration", "parse_override", "preset_tree", "set_key", "to_yaml"]
