"""Where an exported model runs, each as a drop-in ``torch.nn.Module``: :mod:`.onnx` (ONNX Runtime,
the exported model's :class:`~.onnx.ModelInfo`), :mod:`.onnx_fusion` (its transformer graph fusions),
:mod:`.openvino` (OpenVINO IR, NNCF INT8) and :mod:`.tensorrt` (TensorRT engines on an NVIDIA GPU)."""
