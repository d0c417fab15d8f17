"""Model layer: the model-family registry (ViT and DeiT today), the ViT and its blocks, attention
backends, position encodings, gradient checkpointing, the per-shape choices and weight import."""

from vitflow.models.registry import (
                                     FAMILIES,
                                     MODELS,
                                     check_config,
                                     create_model,
                                     family_of,
                                     list_models,
                                     model_args,
                                     model_kwargs,
)
from vitflow.models.vit.model import VisionTransformer

__all__ = ["FAMILIES", "MODELS", "VisionTransformer", "check_config", "create_model", "family_of", "list_models",
           "model_args", "model_kwargs"]
