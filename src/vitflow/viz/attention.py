"""Attention maps of a trained ViT: per-head attention to the patches and attention rollout.

``vitflow attention CHECKPOINT IMAGE -o maps.png`` runs :func:`attention_figure`: the image as
the model sees it (the checkpoint's eval preprocessing), each head's attention to the patches in
one layer (default the last), and the attention rollout over all layers (Abnar & Zuidema 2020),
each overlaid on the image. What a map shows follows the model's pooling
(:func:`attention_kind`): for ``global_pool="token"`` the class token's attention (the row the
head reads), otherwise (``avg``, ``map``, no class token) the mean attention over the patch
tokens' rows; the figure's title says which. The probabilities come from
``model.attention_maps`` (explicit softmax whatever the training backend).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitflow.data import model_input
from vitflow.data.decode import decode_image
from vitflow.infer import Predictor

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


def attention_plot(image: torch.Tensor, head_maps: torch.Tensor, rollout: torch.Tensor, title: str = "",
                   layer: int = -1, rollout_label: str = "rollout (all layers)"):
    """A matplotlib ``Figure`` (no pyplot: any backend, shown inline in Jupyter): the image, one
    overlay per head, the rollout overlay (titled ``rollout_label``).

    Args:
        image: ``uint8 (3, S, S)`` as fed to the model.
        head_maps: ``(H, h, w)`` per-head maps in [0, 1]; rollout: ``(h, w)``.
    """
    from matplotlib.figure import Figure

    img = image.permute(1, 2, 0).cpu().numpy()
    size = img.shape[:2]

    def up(m: torch.Tensor) -> np.ndarray:
        return F.interpolate(m[None, None].float(), size=size, mode="bilinear", align_corners=False)[0, 0].numpy()

    panels = [("image", None)] + [(f"head {h} (layer {layer})", up(m)) for h, m in enumerate(head_maps)]
    panels.append((rollout_label, up(rollout)))
    cols = min(len(panels), 5)
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(2.6 * cols, 2.6 * rows + (0.4 if title else 0)), dpi=110)
    for i, (name, m) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax.imshow(img, interpolation="nearest" if size[0] < 64 else "antialiased")
        if m is not None:
            ax.imshow(m, cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
        ax.set_title(name, fontsize=9)
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_attention(image: torch.Tensor, head_maps: torch.Tensor, rollout: torch.Tensor, out: str | Path,
                   title: str = "", layer: int = -1, rollout_label: str = "rollout (all layers)") -> Path:
    """Write :func:`attention_plot`'s grid as a PNG to ``out``; returns the path."""
    fig = attention_plot(image, head_maps, rollout, title, layer, rollout_label)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


@torch.no_grad()
def attention_maps(predictor: Predictor, pixels: torch.Tensor, layer: int = -1, head_fusion: HeadFusion = "mean",
                   name: str = "image") -> dict:
    """The attention maps of ``predictor``'s PyTorch model on one preprocessed image.

    Args:
        pixels: ``uint8 (3, S, S)``, the image after ``predictor.transform`` (the eval preprocessing).
    Returns:
        ``{"figure"`` (:func:`attention_plot`), ``"heads"`` ``(H, h, w)``, ``"rollout"`` ``(h, w)``,
        ``"class", "prob", "layer", "grid", "maps"}`` (``maps``: what they show,
        :func:`attention_kind`).
    Raises:
        ValueError: ``layer`` out of range, or a model without attention maps (ONNX / INT8 files).
    """
    model, pp = predictor.model, predictor.pp
    if not hasattr(model, "attention_maps") or not hasattr(model, "blocks"):
        raise ValueError(f"{predictor.name}: attention maps need the PyTorch model (a run or checkpoint), not an "
                         "exported or quantized file")
    depth = len(model.blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"--layer {layer} out of range for a {depth}-block model")
    x = model_input(pixels[None], pp.mean, pp.std, predictor.device, predictor.dtype)
    maps = [m.float().cpu() for m in model.attention_maps(x)]
    prob, idx = model(x).float().softmax(-1)[0].max(0)
    grid = (x.shape[-2] // model.patch_size, x.shape[-1] // model.patch_size)
    p, kind = model.num_prefix_tokens, attention_kind(model)
    if hasattr(model, "attention_grid"):  # hierarchical (Swin, MViT): the layer's stage grid, rollout within it
        grid = model.attention_grid(layer % depth, (x.shape[-2], x.shape[-1]))
        maps = [m for m in maps[:layer % depth + 1] if m.shape[-1] == p + grid[0] * grid[1]]
    heads = token_grid(maps[-1 if hasattr(model, "attention_grid") else layer][0], p, grid, kind)
    rollout = token_grid(attention_rollout(maps, head_fusion)[0], p, grid, kind)
    label = predictor.classes[int(idx)]
    rolled = "rollout (all layers)" if not hasattr(model, "attention_grid") else \
        f"rollout (blocks {layer % depth - len(maps) + 1}-{layer % depth}, one stage)"
    figure = attention_plot(pixels, heads, rollout, f"{name}: {label} ({float(prob):.1%}); maps: {kind}",
                            layer % depth, rolled)
    return {"figure": figure, "heads": heads, "rollout": rollout, "class": label, "prob": float(prob),
            "layer": layer % depth, "grid": list(grid), "maps": kind}


def attention_figure(checkpoint: str | Path, image: str | Path, out: str | Path, layer: int = -1,
                     head_fusion: HeadFusion = "mean") -> dict:
    """Attention maps of ``checkpoint`` on one image file (:func:`attention_maps`), written as a PNG
    grid to ``out``.

    Returns:
        ``{"image", "output", "class", "prob", "layer", "heads", "grid", "maps"}`` (``heads``: their
        count; ``maps``: what they show, :func:`attention_kind`).
    Raises:
        FileNotFoundError: missing checkpoint or image. ValueError: unreadable image or
        checkpoint, or ``layer`` out of range.
    """
    image = Path(image)
    if not image.is_file():
        raise FileNotFoundError(f"image not found: {image}")
    predictor = Predictor.from_checkpoint(checkpoint, device="cpu", precision="fp32")
    pixels = predictor.transform(decode_image(image.read_bytes(), str(image)))
    r = attention_maps(predictor, pixels, layer, head_fusion, image.name)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    r.pop("figure").savefig(out)
    return {"image": str(image), "output": str(out), **{k: v for k, v in r.items() if k != "rollout"},
            "heads": r["heads"].shape[0]}
