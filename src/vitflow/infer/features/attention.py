"""Where a transformer classifier looks, as numbers: each head's attention to the patches in one
block and the attention rollout over the blocks (Abnar & Zuidema 2020).

:func:`attention_maps` is what ``vitflow attention`` draws (:mod:`vitflow.viz.attention`) and what
``vitflow serve`` answers on ``/v1/attention``. What a map shows follows the model's pooling
(:func:`attention_kind`): for ``global_pool="token"`` the class token's attention (the row the head
reads), otherwise (``avg``, ``map``, no class token) the mean attention over the patch tokens' rows.
The probabilities come from ``model.attention_maps`` (explicit softmax whatever the training backend).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

HeadFusion = Literal["mean", "max", "min"]


def attention_rollout(maps: Sequence[torch.Tensor], head_fusion: HeadFusion = "mean",
                      residual: float = 0.5) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

    Each layer's heads are fused (mean, or max / min as in later work), the residual path is
    added as ``A' = residual * I + (1 - residual) * A`` with rows renormalised, and the layers are
    multiplied from the first: ``R = A'_L ... A'_2 A'_1``.

    Args:
        maps: per-layer probabilities ``(B, H, N, N)``, first layer first.
    Returns:
        ``(B, N, N)`` float32; row ``i`` is how much each input token flows into output token ``i``.
    Raises:
        ValueError: empty ``maps`` or an unknown ``head_fusion``.
    """
    if not maps:
        raise ValueError("attention_rollout needs at least one layer")
    fuse = {"mean": lambda a: a.mean(1), "max": lambda a: a.amax(1), "min": lambda a: a.amin(1)}
    if head_fusion not in fuse:
        raise ValueError(f"head_fusion must be mean, max or min, got {head_fusion!r}")
    n = maps[0].shape[-1]
    eye = torch.eye(n, device=maps[0].device)
    result = eye.expand(maps[0].shape[0], n, n)
    for a in maps:
        a = residual * eye + (1 - residual) * fuse[head_fusion](a.float())
        result = (a / a.sum(-1, keepdim=True)) @ result
    return result


CLASS_TOKEN = "class-token attention"
PATCH_MEAN = "mean attention over patch tokens"


def attention_kind(model: torch.nn.Module) -> str:
    """What the maps of ``model`` show: :data:`CLASS_TOKEN` when it pools its class token
    (``global_pool="token"`` with a prefix token), else :data:`PATCH_MEAN` (``avg`` / ``map``
    pooling, or no class token)."""
    pool = getattr(model, "global_pool", "token")
    return CLASS_TOKEN if pool == "token" and getattr(model, "num_prefix_tokens", 0) else PATCH_MEAN


def token_grid(rows: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int],
               kind: str | None = None) -> torch.Tensor:
    """Attention to the patch tokens, as ``(..., h, w)`` scaled to a maximum of 1: from the class
    token (row 0) for :data:`CLASS_TOKEN`, else the mean over the patch tokens' rows
    (:data:`PATCH_MEAN`). ``kind`` defaults to the class token when there is a prefix token.

    Args:
        rows: ``(..., N, N)`` probabilities or rollout.
    """
    kind = kind or (CLASS_TOKEN if num_prefix_tokens else PATCH_MEAN)
    x = rows[..., 0, :] if kind == CLASS_TOKEN else rows[..., num_prefix_tokens:, :].mean(-2)
    x = x[..., num_prefix_tokens:].reshape(*x.shape[:-1], *grid)
    return x / x.flatten(-2).amax(-1)[..., None, None].clamp_min(1e-12)


@torch.no_grad()
def attention_maps(model: torch.nn.Module, x: torch.Tensor, layer: int = -1,
                   head_fusion: HeadFusion = "mean") -> dict:
    """The attention maps of a PyTorch ViT, Swin or MViTv2 on one image.

    Args:
        model: a vitflow model with ``attention_maps`` and ``blocks`` (no TTA wrapper).
        x: the model's input ``(1, 3, S, S)`` (normalised, the model's device and dtype).
        layer: the block whose heads are shown (negative: from the last).
    Returns:
        ``{"heads": float32 (H, h, w), "rollout": float32 (h, w)`` (each scaled to a maximum of 1),
        ``"probs": float32 (classes,)`` (the softmax of the logits), ``"layer"`` (from 0),
        ``"grid": (h, w)``, ``"maps"`` (what they show, :func:`attention_kind`), ``"rollout_label"}``.
        A hierarchical model (Swin, MViTv2: ``attention_grid``) rolls out within the stage of ``layer``.
    Raises:
        ValueError: ``layer`` out of range, or a model without attention maps (an ONNX / OpenVINO /
        INT8 runtime model).
    """
    if not hasattr(model, "attention_maps") or not hasattr(model, "blocks"):
        raise ValueError("attention maps need the PyTorch model (a run or checkpoint), not an exported or "
                         "quantized file")
    depth = len(model.blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"--layer {layer} out of range for a {depth}-block model")
    maps = [m.float().cpu() for m in model.attention_maps(x)]
    probs = model(x).float().softmax(-1)[0].cpu()
    grid = (x.shape[-2] // model.patch_size, x.shape[-1] // model.patch_size)
    p, kind, layer = model.num_prefix_tokens, attention_kind(model), layer % depth
    label = "rollout (all layers)"
    if hasattr(model, "attention_grid"):  # hierarchical (Swin, MViT): the layer's stage grid, rollout within it
        grid = model.attention_grid(layer, (x.shape[-2], x.shape[-1]))
        maps = [m for m in maps[:layer + 1] if m.shape[-1] == p + grid[0] * grid[1]]
        label = f"rollout (blocks {layer - len(maps) + 1}-{layer}, one stage)"
        heads = token_grid(maps[-1][0], p, grid, kind)
    else:
        heads = token_grid(maps[layer][0], p, grid, kind)
    rollout = token_grid(attention_rollout(maps, head_fusion)[0], p, grid, kind)
    return {"heads": heads, "rollout": rollout, "probs": probs, "layer": layer, "grid": tuple(grid), "maps": kind,
            "rollout_label": label}
