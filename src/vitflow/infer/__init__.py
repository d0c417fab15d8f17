"""Inference layer: prediction (and, later, export, quantisation, pruning)."""

from vitflow.infer.predict import Predictor, collect_images

__all__ = ["Predictor", "collect_images"]
