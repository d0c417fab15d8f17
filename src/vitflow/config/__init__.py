"""Configuration: the typed tree (:mod:`.schema`; the ``model`` section, one class per kind of
model: :mod:`.model_schema`; the ``data`` section: :mod:`.data_schema`) and how it is built from
presets, YAML files and ``key=value`` overrides (:mod:`.build`, values coerced by :mod:`.coerce`;
model keys across families and old flat ``model`` sections: :mod:`.model_keys`). Pure data:
imports no other part of vitflow."""

from vitflow.config.build import (
                                  RENAMED,
                                  ModelConfigClass,
                                  all_keys,
                                  build_config,
                                  check_attributes,
                                  flatten,
                                  list_presets,
                                  parse_override,
                                  preset_tree,
                                  set_key,
                                  to_yaml,
)
from vitflow.config.checks import ConfigError
from vitflow.config.data_schema import IMAGENET_MEAN, IMAGENET_STD, DataConfig
from vitflow.config.model_keys import (
                                  LEGACY_MODEL_DEFAULTS,
                                  field_names,
                                  holds_old_default,
                                  model_key_defaults,
                                  not_a_key,
                                  retype_model,
)
from vitflow.config.model_schema import (
                                  EvaConfig,
                                  ModelConfig,
                                  MViTConfig,
                                  SwinConfig,
                                  ViTConfig,
                                  ViTLayoutConfig,
                                  model_config_classes,
)
from vitflow.config.schema import (
                                  DEFAULT_PRESET,
                                  Config,
                                  DistillConfig,
                                  FinetuneConfig,
                                  OptimConfig,
                                  TrainConfig,
                                  parse_duration,
)

__all__ = ["DEFAULT_PRESET", "IMAGENET_MEAN", "IMAGENET_STD", "LEGACY_MODEL_DEFAULTS", "RENAMED", "Config",
           "ConfigError", "DataConfig", "DistillConfig", "EvaConfig", "FinetuneConfig", "ModelConfig",
           "ModelConfigClass", "MViTConfig", "OptimConfig", "SwinConfig", "TrainConfig", "ViTConfig", "ViTLayoutConfig", "all_keys", "build_config", "check_attributes",
           "field_names", "flatten", "holds_old_default", "list_presets", "model_config_classes", "model_key_defaults",
           "not_a_key", "parse_duration", "parse_override", "preset_tree", "retype_model", "set_key", "to_yaml"]
