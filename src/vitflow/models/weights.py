"""Reading and writing model weights without executing code from the file.

``.safetensors`` files are read with safetensors; ``.pt``/``.pth``/``.bin`` with
``torch.load(weights_only=True)``, which refuses pickled code; ``.npz`` (Google
vision_transformer / big_vision) with ``numpy.load(allow_pickle=False)``. Hugging Face ViT and
Flax names are converted to timm's layout by :mod:`vitflow.models.convert`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from vitflow.models.convert import convert_hf_vit, convert_jax_npz, is_hf_vit, read_npz
from vitflow.models.position import resample_pos_embed, resample_relative_table
from vitflow.models.vit import VisionTransformer

log = logging.getLogger(__name__)

_WRAPPER_KEYS = ("model", "state_dict", "model_state", "module")


def load_error_reason(e: BaseException, path: str | Path | None = None) -> str:
    """One short line saying why ``torch.load(..., weights_only=True)`` (or safetensors) refused a
    file, instead of torch's multi-line advice (which suggests ``weights_only=False``: never for
    an untrusted file). With the ``path`` of a ``torch.load`` file, a file that is neither a zip
    (torch >= 1.6) nor a pickle is named as such."""
    if path is not None:
        with open(path, "rb") as f:
            head = f.read(8)
        if not head.startswith((b"PK\x03\x04", b"\x80")):
            return f"not a PyTorch file (it starts with {head!r})"
    msg = str(e).strip()
    if "Weights only load failed" in msg:
        detail = msg.split("WeightsUnpickler error:", 1)[-1] if "WeightsUnpickler error:" in msg else ""
        return ("not a PyTorch weights file, or one holding pickled objects other than tensors (refused: loading "
                f"them could run code){f'; {_first_sentence(detail)}' if detail else ''}")
    return _first_sentence(msg) if msg else type(e).__name__


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.split(". ")[0].rstrip(".") if len(line) > 120 else line


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a flat ``{name: tensor}`` dict in timm's ViT layout from a weights file or a vitflow
    checkpoint.

    Nested dicts under ``model`` / ``state_dict`` / ``module`` are unwrapped, a ``module.``
    prefix (DDP) is stripped, Hugging Face ViT names and ``.npz`` Flax checkpoints are converted
    (:mod:`vitflow.models.convert`).

    Raises:
        FileNotFoundError: no such file. ValueError: the file is not a readable weights file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix.lower() == ".onnx":
        raise ValueError(f"{path} is an ONNX model, not weights (.safetensors, .pth, .bin, .npz or a vitflow .pt)")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        elif path.suffix == ".npz":
            arrays = read_npz(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or carrying pickled code
        torch_file = path.suffix not in (".safetensors", ".npz")
        raise ValueError(f"cannot read weights from {path}: {load_error_reason(e, path if torch_file else None)}") from e
    if path.suffix == ".npz":
        try:
            return convert_jax_npz(arrays)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    for key in _WRAPPER_KEYS:
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state_dict of tensors")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    if is_hf_vit(sd):
        try:
            sd = convert_hf_vit(sd)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return sd


def adapt_state_dict(sd: dict[str, torch.Tensor], model: VisionTransformer) -> dict[str, torch.Tensor]:
    """Fit a timm-layout ViT state_dict to ``model``: resample ``pos_embed`` (bicubic) and
    relative position bias tables to the model's grid, drop a learned ``pos_embed`` the model
    does not use (``sincos2d`` / ``relative``), and drop a ``head`` whose class count differs
    (it stays freshly initialised)."""
    sd = dict(sd)
    grid = (model.grid_size, model.grid_size)
    pos = sd.get("pos_embed")
    if pos is not None and not isinstance(model.pos_embed, torch.nn.Parameter):
        log.info("dropping the file's learned pos_embed: the model uses pos_embed=%s", model.pos_embed_type)
        sd.pop("pos_embed")
    elif pos is not None and pos.shape != model.pos_embed.shape:
        log.info("resampling pos_embed %s -> %s", tuple(pos.shape), tuple(model.pos_embed.shape))
        sd["pos_embed"] = resample_pos_embed(pos, grid, model.pos_embed_prefix_tokens)  # 0 with no_embed_class
    own = model.state_dict()
    for key in [k for k in sd if k.endswith("relative_position_bias_table")]:
        if key in own and sd[key].shape != own[key].shape:
            rows = sd[key].shape[0] - (3 if model.num_prefix_tokens else 0)
            side = (math.isqrt(rows) + 1) // 2
            log.info("resampling %s %s -> %s", key, tuple(sd[key].shape), tuple(own[key].shape))
            sd[key] = resample_relative_table(sd[key], (side, side), grid, model.num_prefix_tokens)
    head = sd.get("head.weight")
    own_head = own.get("head.weight")
    if head is not None and (own_head is None or head.shape != own_head.shape):
        log.info("dropping head %s: model has %d classes", tuple(head.shape), model.num_classes)
        sd.pop("head.weight", None)
        sd.pop("head.bias", None)
    return sd


_NEW_OK = ("head.", ".attn.kernel.", "relative_position_bias_table")  # may stay freshly initialised


def load_pretrained(model: VisionTransformer, path: str | Path) -> None:
    """Load weights from ``path`` into ``model`` (see :func:`adapt_state_dict`); every other
    parameter must match by name and shape. The head, attention-kernel parameters (Linformer
    projections, Performer features) and relative position bias tables absent from the file
    keep their initialisation (logged).

    Raises:
        ValueError: missing or unexpected keys, or shape mismatches (all named in the message).
    """
    sd = adapt_state_dict(read_state_dict(path), model)
    own = model.state_dict()
    new = [k for k in own if k not in sd and any(s in k for s in _NEW_OK)]
    if new:
        log.info("%d tensors not in %s keep their initialisation (e.g. %s)", len(new), path, new[0])
    missing = [k for k in own if k not in sd and k not in new]
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
