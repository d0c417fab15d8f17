"""Reading and writing model weights without executing code from the file.

``.safetensors`` files are read with safetensors; ``.pt``/``.pth``/``.bin`` with
``torch.load(weights_only=True)``, which refuses pickled code.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vitflow.models.vit import VisionTransformer, resample_pos_embed

log = logging.getLogger(__name__)

_WRAPPER_KEYS = ("model", "state_dict", "model_state", "module")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a flat ``{name: tensor}`` dict from a weights file or a vitflow checkpoint.

    Nested dicts under ``model`` / ``state_dict`` / ``module`` are unwrapped and a ``module.``
    prefix (DDP) is stripped.

    Raises:
        FileNotFoundError: no such file. ValueError: the file is not a readable weights file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or carrying pickled code
        raise ValueError(f"cannot read weights from {path}: {e}") from e
    for key in _WRAPPER_KEYS:
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def adapt_state_dict(sd: dict[str, torch.Tensor], model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Fit a timm-layout ViT state_dict to ``model``: resample ``pos_embed`` to the model's grid
    and drop a ``head`` whose class count differs (it stays freshly initialised)."""
    sd = dict(sd)
    pos = sd.get("pos_embed")
    if pos is not None and pos.shape != model.pos_embed.shape:
        log.info("resampling pos_embed %s -> %s", tuple(pos.shape), tuple(model.pos_embed.shape))
        sd["pos_embed"] = resample_pos_embed(pos, (model.grid_size, model.grid_size), model.num_prefix_tokens)
    head = sd.get("head.weight")
    own = model.state_dict().get("head.weight")
    if head is not None and (own is None or head.shape != own.shape):
        log.info("dropping head %s: model has %d classes", tuple(head.shape), model.num_classes)
        sd.pop("head.weight", None)
        sd.pop("head.bias", None)
    return sd


def load_pretrained(model: VisionTransformer, path: str | Path) -> None:
    """Load weights from ``path`` into ``model`` (see :func:`adapt_state_dict`); every other
    parameter must match by name and shape.

    Raises:
        ValueError: missing or unexpected keys, or shape mismatches (all named in the message).
    """
    sd = adapt_state_dict(read_state_dict(path), model)
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.startswith("head.")]
    unexpected = [k for k in sd if k not in own]
    mismatched = [f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in sd if k in own and sd[k].shape != own[k].shape]
    if missing or unexpected or mismatched:
        raise ValueError(f"weights in {path} do not fit this model: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]} mismatched={mismatched[:5]}")
    model.load_state_dict(sd, strict=False)


def save_safetensors(model: torch.nn.Module, path: str | Path) -> None:
    """Write the model's state_dict to a ``.safetensors`` file (contiguous copies)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
