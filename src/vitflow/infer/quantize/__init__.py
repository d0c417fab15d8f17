"""Smaller numbers for deployment: :mod:`.dynamic` (``vitflow quantize``: dynamic INT8 with ONNX
Runtime or PyTorch, FP16 / BF16 casts), :mod:`.static` (static INT8 with calibration) and
:mod:`.guard` (the accuracy guard that refuses a model that lost too much top-1)."""
