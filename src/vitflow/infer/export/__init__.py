"""A trained model written for deployment: :mod:`.formats` (ONNX that verifies itself, TorchScript,
ExportedProgram, OpenVINO IR, TensorRT; ``vitflow export``), :mod:`.hub_folder` (a hub-style folder
that timm loads too) and :mod:`.model_card` (its README)."""
