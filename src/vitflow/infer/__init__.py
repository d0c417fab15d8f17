"""Inference layer: a trained model put to use. Prediction on files, folders and tars
(:mod:`.predict`, test-time augmentation :mod:`.tta`), evaluation of a checkpoint
(:mod:`.evaluate`), the real images the tools check themselves on (:mod:`.calibration`) and head
and MLP pruning (:mod:`.prune`); in sub-packages: :mod:`.runtimes` (ONNX Runtime, OpenVINO,
TensorRT as drop-in models), :mod:`.export` (ONNX that verifies itself, TorchScript,
ExportedProgram, OpenVINO IR, TensorRT engines, hub-style folders), :mod:`.quantize` (INT8 dynamic
and static, half precision, the accuracy guard), :mod:`.bench` (``vitflow bench infer`` and
``bench resolution``), :mod:`.features` (embeddings, k-NN, backbones) and :mod:`.serve` (the HTTP
service)."""

from vitflow.infer.predict import Predictor, collect_images

__all__ = ["Predictor", "collect_images"]
