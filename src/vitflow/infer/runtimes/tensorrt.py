"""TensorRT engines from vitflow's ONNX exports, built and run on an NVIDIA GPU (``vitflow
export --format tensorrt``). Elsewhere every entry point raises
:class:`~vitflow.infer.runtimes.onnx.UnavailableError` before any work, saying what is missing."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn

from vitflow.infer.runtimes.onnx import UnavailableError


def tensorrt_available() -> str | None:
    """``None`` when TensorRT engines can be built here, else the reason they cannot."""
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed (pip install tensorrt, on a machine with an NVIDIA GPU)"
    if not torch.cuda.is_available():
        return "no NVIDIA GPU is visible to PyTorch (torch.cuda.is_available() is False)"
    return None


def build_tensorrt_engine(onnx_path: str | Path, engine_path: str | Path, fp16: bool = True,
                          batch_sizes: tuple[int, int, int] = (1, 32, 128), workspace_gib: float = 4.0) -> dict:
    """Build a serialized TensorRT engine from a vitflow ONNX export (NVIDIA TensorRT 8.6+/10.x
    Python API: ``OnnxParser`` -> builder config with an optimisation profile over the batch
    dimension ``(min, opt, max) = batch_sizes``; FP16 kernels allowed when ``fp16``).

    Returns:
        ``{"engine": path, "build_s": seconds, "bytes": size, "fp16": bool}``.
    Raises:
        UnavailableError: no ``tensorrt`` package or no CUDA GPU (the message says which).
        ValueError: the ONNX model cannot be parsed or the build fails.
    """
    reason = tensorrt_available()
    if reason:
        raise UnavailableError(f"cannot build a TensorRT engine: {reason}")
    import tensorrt as trt

    t0 = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH") and int(trt.__version__.split(".")[0]) < 10:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 1024**3))
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    inp = network.get_input(0)
    shape = tuple(inp.shape)[1:]
    profile = builder.create_optimization_profile()
    profile.set_shape(inp.name, *[(b, *shape) for b in batch_sizes])
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ValueError(f"TensorRT failed to build an engine from {onnx_path} (see the TensorRT log above)")
    data = bytes(serialized)
    Path(engine_path).write_bytes(data)
    return {"engine": str(engine_path), "build_s": time.perf_counter() - t0, "bytes": len(data), "fp16": fp16}


class TensorRTModel(nn.Module):
    """A TensorRT engine (from :func:`build_tensorrt_engine`) as a module (TensorRT 10 tensor API).

    ``forward(x)``: ``float32 (B, 3, S, S)`` on the GPU or CPU -> logits ``float32 (B, C)`` on the
    GPU. Raises UnavailableError without TensorRT or a GPU.
    """

    def __init__(self, engine_path: str | Path):
        super().__init__()
        reason = tensorrt_available()
        if reason:
            raise UnavailableError(f"cannot run a TensorRT engine: {reason}")
        import tensorrt as trt

        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise ValueError(f"cannot deserialize TensorRT engine {engine_path}")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_name = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
        self.output_name = next(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to("cuda", torch.float32).contiguous()
        self.context.set_input_shape(self.input_name, tuple(x.shape))
        out = torch.empty(tuple(self.context.get_tensor_shape(self.output_name)), device="cuda", dtype=torch.float32)
        self.context.set_tensor_address(self.input_name, x.data_ptr())
        self.context.set_tensor_address(self.output_name, out.data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return out
