"""Model layer: the ViT, its attention backends, the variant registry and weight I/O."""

from vitflow.models.registry import MODELS, create_model, list_models, model_kwargs
from vitflow.models.vit import VisionTransformer

__all__ = ["MODELS", "VisionTransformer", "create_model", "list_models", "model_kwargs"]
