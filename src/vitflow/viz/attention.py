"""Attention maps of a trained ViT drawn: per-head attention to the patches and attention rollout.

``vitflow attention CHECKPOINT IMAGE -o maps.png`` runs :func:`attention_figure`: the image as
the model sees it (the checkpoint's eval preprocessing), each head's attention to the patches in
one layer (default the last), and the attention rollout over all layers (Abnar & Zuidema 2020),
each overlaid on the image. The maps themselves, and what they show for each pooling
(:func:`vitflow.infer.features.attention.attention_kind`), come from
:mod:`vitflow.infer.features.attention`; the figure's title says which.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from vitflow.data import model_input
from vitflow.data.decode import decode_image
from vitflow.infer import Predictor
from vitflow.infer.features.attention import HeadFusion
from vitflow.infer.features.attention import attention_maps as model_attention


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
    """The attention maps of ``predictor``'s PyTorch model on one preprocessed image
    (:func:`vitflow.infer.features.attention.attention_maps`), with their figure.

    Args:
        pixels: ``uint8 (3, S, S)``, the image after ``predictor.transform`` (the eval preprocessing).
    Returns:
        ``{"figure"`` (:func:`attention_plot`), ``"heads"`` ``(H, h, w)``, ``"rollout"`` ``(h, w)``,
        ``"class", "prob", "layer", "grid", "maps"}`` (``maps``: what they show,
        :func:`attention_kind`).
    Raises:
        ValueError: ``layer`` out of range, or a model without attention maps (ONNX / INT8 files).
    """
    x = model_input(pixels[None], predictor.pp.mean, predictor.pp.std, predictor.device, predictor.dtype)
    try:
        r = model_attention(predictor.model, x, layer, head_fusion)
    except ValueError as e:
        raise ValueError(f"{predictor.name}: {e}") from None
    prob, idx = r["probs"].max(0)
    label = predictor.classes[int(idx)]
    figure = attention_plot(pixels, r["heads"], r["rollout"], f"{name}: {label} ({float(prob):.1%}); maps: {r['maps']}",
                            r["layer"], r["rollout_label"])
    return {"figure": figure, "heads": r["heads"], "rollout": r["rollout"], "class": label, "prob": float(prob),
            "layer": r["layer"], "grid": list(r["grid"]), "maps": r["maps"]}


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
