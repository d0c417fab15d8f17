"""Inference layer: a trained model put to use. Prediction on files, folders and tars
(:mod:`.predict`, test-time augmentation :mod:`.tta`), evaluation of a checkpoint
(:mod:`.evaluate`), features and k-NN (:mod:`.embed`, :mod:`.knn`, backbones :mod:`.backbone`),
export (:mod:`.export`: ONNX that verifies itself, TorchScript, ExportedProgram; TensorRT
:mod:`.tensorrt`; hub-style folders :mod:`.hub_folder`), INT8 / half precision (:mod:`.quantize`),
head and MLP pruning (:mod:`.prune`) and the inference benchmark (:mod:`.bench`)."""

from vitflow.infer.predict import Predictor, collect_images

__all__ = ["Predictor", "collect_images"]
