"""vitflow: train, evaluate, inspect and deploy Vision Transformer image classifiers."""

from vitflow.models import VisionTransformer, create_model, list_models

__version__ = "0.1.0"
__all__ = ["VisionTransformer", "create_model", "list_models", "__version__"]
