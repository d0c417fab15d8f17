"""Model layer: the model-family registry (:mod:`.registry`, :mod:`.family`: each family's variants
and ``model`` section, :func:`config_class`) and one package per family (:mod:`.vit`: ViT, DeiT,
DeiT III, DINOv2, CLIP, SigLIP; :mod:`.eva`: EVA-02, DINOv3, BEiT; :mod:`.swin`: Swin, Swin V2),
with what they share here (layers, the pre-norm block, position encodings and RoPE, pooling, LoRA,
gradient checkpointing, the per-shape choices); the attention math (:mod:`.attention`), the CPU
kernels and their choice (:mod:`.kernels`), foreign weight layouts (:mod:`.convert`) and
pretrained weights (:mod:`.pretrained`)."""

from vitflow.models.registry import (
                                     FAMILIES,
                                     MODELS,
                                     check_config,
                                     config_class,
                                     create_model,
                                     family_of,
                                     list_models,
                                     model_args,
                                     model_kwargs,
)
from vitflow.models.vit.model import VisionTransformer

__all__ = ["FAMILIES", "MODELS", "VisionTransformer", "check_config", "config_class", "create_model", "family_of",
           "list_models", "model_args", "model_kwargs"]
