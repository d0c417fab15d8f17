"""Reading and writing model weights without executing code from the file.

``.safetensors`` files are read with safetensors; ``.pt``/``.pth``/``.bin`` with
``torch.load(weights_only=True)``, which refuses pickled code; ``.npz`` (Google
vision_transformer / big_vision) with ``numpy.load(allow_pickle=False)``. Foreign names are
converted to timm's layout: Hugging Face ViT and Flax by :mod:`vitflow.models.convert.vit`, Hugging
Face DINOv2 / DINOv3 / CLIP / SigLIP / BEiT by :mod:`vitflow.models.convert.hf`, Hugging Face
Swin / Swin V2 by :mod:`vitflow.models.convert.hf_swin`, torchvision's MViTv2 by
:mod:`vitflow.models.convert.torchvision_mvit`, OpenCLIP by
:mod:`vitflow.models.convert.openclip`. :func:`load_pretrained` is every family's loader.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from vitflow.models.convert.hf import CONVERTERS, detect_hf_layout
from vitflow.models.convert.hf_swin import detect_hf_swin, hf_swin_to_timm
from vitflow.models.convert.openclip import convert_openclip, is_openclip
from vitflow.models.convert.torchvision_mvit import is_torchvision_mvit, torchvision_mvit_to_timm
from vitflow.models.convert.vit import convert_hf_vit, convert_jax_npz, is_hf_vit, read_npz
from vitflow.models.lora import has_lora_weights, merge_lora_state_dict
from vitflow.models.position import resample_pos_embed, resample_relative_table
from vitflow.models.pretrained.hub import resolve_pretrained
from vitflow.models.pretrained.mvit_fit import adapt_mvit_state_dict, is_mvit_model
from vitflow.models.pretrained.swin_fit import adapt_swin_state_dict, is_swin_model

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


def detect_layout(sd: dict[str, torch.Tensor]) -> str:
    """The naming layout of a state_dict: ``"openclip"``, a Hugging Face family (``"hf_vit"``,
    ``"hf_dinov2"``, ``"hf_dinov3"``, ``"hf_clip"``, ``"hf_siglip"``, ``"hf_beit"``, ``"hf_swin"``,
    ``"hf_swinv2"``), torchvision's MViT (``"torchvision_mvit"``), ``"timm"`` (timm / vitflow
    names), or ``"unknown"``; from the key names alone."""
    keys = set(sd)
    if is_openclip(keys):
        return "openclip"
    if is_torchvision_mvit(keys):
        return "torchvision_mvit"
    family = detect_hf_swin(keys) or detect_hf_layout(keys)
    if family:
        return family
    if is_hf_vit(sd):
        return "hf_vit"
    if any(k.startswith(("patch_embed.", "blocks.")) for k in keys):
        return "timm"
    return "unknown"


def convert_layout(sd: dict[str, torch.Tensor], where: str | Path, known: bool = True) -> dict[str, torch.Tensor]:
    """``sd`` in timm names (:func:`detect_layout`, then the family's converter); with
    ``known=False`` a state_dict of an unknown layout is returned as it is.

    Raises:
        ValueError: an unknown layout (naming a few of its keys) or a key the converter does
        not know, with ``where`` (the file).
    """
    layout = detect_layout(sd)
    if layout == "unknown" and not known:
        return sd
    if layout == "unknown":
        raise ValueError(f"{where}: weights of an unknown layout (neither timm, Hugging Face nor OpenCLIP names); "
                         f"unexpected names e.g. {', '.join(list(sd)[:4])}")
    convert = {"openclip": convert_openclip, "hf_vit": convert_hf_vit, "hf_swin": hf_swin_to_timm,
               "hf_swinv2": hf_swin_to_timm, "torchvision_mvit": torchvision_mvit_to_timm, **CONVERTERS}.get(layout)
    if convert is None:
        return sd
    try:
        out = convert(sd)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    log.info("%s: %s layout converted to timm names (%d tensors)", where, layout, len(out))
    return out


def read_state_dict(path: str | Path, known_layout: bool = False) -> dict[str, torch.Tensor]:
    """Load a flat ``{name: tensor}`` dict in timm's layout from a weights file or a vitflow
    checkpoint, reading nothing that could run code.

    Nested dicts under ``model`` / ``state_dict`` / ``module`` are unwrapped, a ``module.``
    prefix (DDP) is stripped, foreign names are converted (:func:`convert_layout`: Hugging Face
    ViT, DINOv2, DINOv3, CLIP, SigLIP, BEiT; OpenCLIP; ``.npz`` Flax checkpoints). Names of no
    known layout are returned as they are, or refused with ``known_layout=True``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable weights file (a pickle holding objects other than tensors is
            refused), or weights of an unknown layout.
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
        reason = load_error_reason(e, path if torch_file else None)
        hint = "" if "refused" in reason else " (a truncated or corrupt file? download or copy it again)"
        raise ValueError(f"cannot read weights from {path}: {reason}{hint}") from e
    if path.suffix == ".npz":
        try:
            return convert_jax_npz(arrays)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    args = sd.get("model_args") if isinstance(sd, dict) else None
    lora = args.get("lora") if isinstance(args, dict) else None  # a LoRA-trained vitflow checkpoint
    for key in _WRAPPER_KEYS:
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state_dict of tensors")
    if lora and has_lora_weights(sd):
        sd = merge_lora_state_dict(sd, lora["alpha"])  # adapters folded into the base weights
    return convert_layout({k.removeprefix("module."): v for k, v in sd.items()}, path, known_layout)


def model_grid(model: torch.nn.Module) -> tuple[int, int]:
    """The model's patch grid ``(h, w)``: ``grid_size`` (int or pair) of the model or of its
    ``patch_embed``, else ``img_size // patch_size``."""
    grid = getattr(model, "grid_size", None) or getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None:
        size, patch = getattr(model, "img_size"), getattr(model, "patch_size")
        size = size if isinstance(size, (tuple, list)) else (size, size)
        patch = patch if isinstance(patch, (tuple, list)) else (patch, patch)
        grid = (size[0] // patch[0], size[1] // patch[1])
    return (grid, grid) if isinstance(grid, int) else (int(grid[0]), int(grid[1]))


def adapt_state_dict(sd: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Fit a timm-layout state_dict to ``model`` (any family): resample a learned ``pos_embed``
    (bicubic) to the model's grid, its prefix rows kept (``num_prefix_tokens``, none with
    ``no_embed_class``); resample relative position bias tables; drop a learned ``pos_embed``
    the model does not use (``sincos2d`` / ``relative`` / RoPE); reset a head of another class
    count (dropped here, logged ``head reset: 1000 -> 5 classes``). A Swin model's state_dict goes
    to :func:`vitflow.models.pretrained.swin_fit.adapt_swin_state_dict` (window tables, head) instead, an
    MViT's to :func:`vitflow.models.pretrained.mvit_fit.adapt_mvit_state_dict` (relative tables, head)."""
    if is_swin_model(model):
        return adapt_swin_state_dict(sd, model)
    if is_mvit_model(model):
        return adapt_mvit_state_dict(sd, model)
    sd = dict(sd)
    own = model.state_dict()
    grid = model_grid(model)
    pos = sd.get("pos_embed")
    own_pos = own.get("pos_embed")
    if pos is not None and own_pos is None:
        log.info("dropping the file's learned pos_embed: the model has none (pos_embed=%s)",
                 getattr(model, "pos_embed_type", "rope or fixed"))
        sd.pop("pos_embed")
    elif pos is not None and pos.shape != own_pos.shape and pos.shape[-1] == own_pos.shape[-1]:  # another grid
        prefix = 0 if getattr(model, "no_embed_class", False) else int(getattr(model, "num_prefix_tokens", 1))
        log.info("resampling pos_embed %s -> %s", tuple(pos.shape), tuple(own_pos.shape))
        sd["pos_embed"] = resample_pos_embed(pos, grid, prefix)
    with_cls = int(getattr(model, "num_prefix_tokens", 1)) > 0
    for key in [k for k in sd if k.endswith("relative_position_bias_table")]:
        if key in own and sd[key].shape != own[key].shape:
            rows = sd[key].shape[0] - (3 if with_cls else 0)
            side = (math.isqrt(rows) + 1) // 2
            log.info("resampling %s %s -> %s", key, tuple(sd[key].shape), tuple(own[key].shape))
            sd[key] = resample_relative_table(sd[key], (side, side), grid, int(with_cls))
    head = sd.get("head.weight")
    if head is not None and (own.get("head.weight") is None or head.shape != own["head.weight"].shape):
        log.info("head reset: %d -> %d classes", head.shape[0], getattr(model, "num_classes", 0))
        for key in [k for k in sd if k.startswith(("head.", "head_dist."))]:
            sd.pop(key)
    return sd


_NEW_OK = ("head.", "head_dist.", ".attn.kernel.", "relative_position_bias_table")  # may stay freshly initialised


def load_pretrained(model: torch.nn.Module, spec: str | Path) -> None:
    """Load pretrained weights into ``model`` (any family with timm's names): resolve ``spec``
    (a file, a snapshot folder or ``hf-hub:ORG/NAME[@rev]``, :func:`vitflow.models.pretrained.hub.resolve_pretrained`),
    read it safely, convert foreign names (:func:`convert_layout`), adapt it
    (:func:`adapt_state_dict`), then ``load_state_dict(strict=True)``. The head, attention-kernel
    parameters, relative position tables and buffers absent from the file keep their
    initialisation (logged); every other tensor must match by name and shape.

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: unreadable or unknown weights, a snapshot without weights, a hub name neither
            cached nor reachable, or weights that do not fit (naming the key and both shapes; a
            snapshot's config that disagrees with its weights).
    """
    pre = resolve_pretrained(spec)
    load_adapted(model, read_state_dict(pre.weights, known_layout=True), pre.weights, pre.source, pre.model_name)


def load_adapted(model: torch.nn.Module, read: dict[str, torch.Tensor], where: str | Path,
                 source: str | Path | None = None, model_name: str | None = None) -> None:
    """Load a timm-layout state_dict ``read`` (from the file ``where``) into ``model`` the way
    :func:`load_pretrained` does: :func:`adapt_state_dict` (position embeddings and relative
    position tables resampled to the model's grid and windows, a head of another class count
    reset), then ``load_state_dict(strict=True)``. Fine-tuning at another ``model.img_size`` and
    ``vitflow bench resolution`` (through :func:`vitflow.checkpoint.model_from_checkpoint`) both
    come here. ``source`` / ``model_name``: a snapshot's folder and the architecture its config
    names, for the message when config and weights disagree.

    Raises:
        ValueError: weights that do not fit (naming the key and both shapes).
    """
    sd = adapt_state_dict(read, model)
    own = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    new = [k for k in own if k not in sd and (k not in params or any(s in k for s in _NEW_OK))]
    missing = [k for k in own if k not in sd and k not in new]
    unexpected = [k for k in sd if k not in own]
    mismatched = [k for k in own if k in sd and sd[k].shape != own[k].shape]
    if mismatched and model_name:
        k = mismatched[0]
        raise ValueError(f"the config of {source} (architecture {model_name}) disagrees with its weights "
                         f"{Path(where).name}: {k} is {tuple(sd[k].shape)} in the weights but {tuple(own[k].shape)} "
                         f"in the model the config describes")
    if missing or unexpected or mismatched:
        shapes = [f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" for k in mismatched]
        raise ValueError(f"weights in {where} do not fit this model{_depth_hint(sd, own)}: "
                         f"missing={missing[:5]} unexpected={unexpected[:5]} mismatched={shapes[:5]}")
    absent = [k for k in new if k not in read]  # the others were dropped by adapt_state_dict, which logged it
    if absent:
        log.info("%d tensors not in %s keep their initialisation (e.g. %s)", len(absent), where, absent[0])
    model.load_state_dict({**{k: own[k] for k in new}, **sd}, strict=True)


def _depth_hint(sd: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    """`` (the file has K blocks, the model D: model.depth=K?)`` when the block counts differ."""
    def blocks(keys) -> int:
        return len({k.split(".")[1] for k in keys if k.startswith("blocks.")})

    have, want = blocks(sd), blocks(own)
    return f" (the file has {have} blocks, the model {want}: model.depth={have}?)" if have and have != want else ""


def save_safetensors(model: torch.nn.Module, path: str | Path) -> None:
    """Write the model's state_dict to a ``.safetensors`` file (contiguous copies)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
