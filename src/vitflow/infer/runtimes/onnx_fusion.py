"""ONNX Runtime's transformer graph fusions for vitflow's ONNX exports (``vitflow export
--optimize``), per target."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from vitflow.infer.runtimes.onnx import copy_metadata, quiet_toolchain, require


def fusion_sizes(model: nn.Module) -> tuple[int, int]:
    """``(num_heads, hidden_size)`` of a ViT-layout model for :func:`optimize_onnx`, ``(0, 0)``
    for other layouts and for head-pruned models whose blocks differ (the optimizer then reads
    them from the graph; given, a head count that does not divide the width fails its check)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not len(blocks) or not hasattr(blocks[0].attn, "num_heads"):
        return 0, 0
    dim = getattr(model, "embed_dim", 0)
    if any(b.attn.num_heads * getattr(b.attn, "head_dim", 0) != dim for b in blocks):
        return 0, 0
    return blocks[0].attn.num_heads, dim


FUSED_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "LayerNormalization", "BiasGelu", "Gelu",
             "FastGelu")
TARGETS = ("cpu", "gpu")


def optimize_onnx(src: str | Path, dst: str | Path, target: str = "cpu", num_heads: int = 0,
                  hidden_size: int = 0) -> dict[str, int]:
    """Apply ONNX Runtime's transformer graph fusions (``onnxruntime.transformers.optimizer``,
    ``model_type="vit"``) for a target.

    - ``gpu``: all of them: multi-head attention into one ``Attention`` op, residual add +
      LayerNorm into ``SkipLayerNormalization``, LayerNorm, bias + GELU into ``BiasGelu``
      (the kernels ONNX Runtime's CUDA / TensorRT providers are built around).
    - ``cpu``: the LayerNorm and GELU fusions only. On the CPU provider (ONNX Runtime 1.32, AVX512,
      measured with ``vitflow bench infer``) the fused ``Attention`` and ``SkipLayerNormalization``
      kernels ran 10-20% slower than the plain graph that ONNX Runtime fuses itself at session
      creation, so they are left out there.

    ``num_heads`` / ``hidden_size`` are fallbacks; the optimizer reads each block's head count
    from its reshape, so head-pruned models fuse too. Writes ``dst`` with ``src``'s vitflow
    metadata.

    Returns:
        ``{op_type: count}`` of the fused nodes in ``dst`` (zero counts left out).
    Raises:
        ValueError: unknown target.
    """
    require("onnxruntime")
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    if target not in TARGETS:
        raise ValueError(f"unknown optimisation target {target!r}; choose one of {list(TARGETS)}")
    options = FusionOptions("vit")
    if target == "cpu":
        options.enable_attention = options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = False
    with quiet_toolchain():
        opt = optimizer.optimize_model(str(src), model_type="vit", num_heads=num_heads, hidden_size=hidden_size,
                                       optimization_options=options, opt_level=0)
        stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v and k in FUSED_OPS}
        opt.save_model_to_file(str(dst))
    copy_metadata(src, dst)
    return stats
