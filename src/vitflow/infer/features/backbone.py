"""A model for frozen-feature work (``vitflow embed``, ``vitflow eval --knn``), from what the user has:
a vitflow run directory or checkpoint, a hub-style folder (:mod:`vitflow.infer.export.hub_folder`), or plain
weights with the architecture named.

:func:`load_backbone` is the one place a weights spec becomes a model and its preprocessing; the
resolution of foreign snapshot folders and ``hf-hub:`` names belongs to the model layer's loader
(``create_model(name, pretrained=spec)``), which this module calls for plain weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.data.transforms import Preprocess
from vitflow.infer.export.hub_folder import CONFIG_NAME, is_hub_folder, read_hub_folder
from vitflow.models import create_model
from vitflow.models.pretrained.config import create_pretrained_model
from vitflow.models.pretrained.hub import resolve_pretrained

log = logging.getLogger(__name__)


@dataclass
class Backbone:
    """A model in eval mode on the CPU with what it needs around it.

    ``model``: has ``forward_features(x) -> (B, N, D)`` and ``forward_head(tokens, pre_logits=True)
    -> (B, D)``; ``preprocess``: its evaluation preprocessing; ``classes``: the class names of its
    head (``None`` for a headless backbone); ``source``: the file or folder it came from;
    ``config``: the run's saved config (checkpoints only), whose ``data`` section k-NN reads.
    """

    model: torch.nn.Module
    preprocess: Preprocess
    classes: list[str] | None
    source: str
    name: str
    config: dict[str, Any] | None = None


def default_preprocess(model: torch.nn.Module) -> Preprocess:
    """ImageNet mean / std, bicubic, crop 0.875 at the model's ``img_size``: for weights that carry
    no preprocessing of their own."""
    return Preprocess(int(getattr(model, "img_size", 224)))


def load_backbone(spec: str | Path, model_name: str | None = None, weights: str = "auto") -> Backbone:
    """The model a frozen-feature command runs.

    Args:
        spec: a vitflow run directory or checkpoint (its model and saved eval preprocessing; the
            head is kept but unused by features), a hub-style folder (``config.json`` +
            ``model.safetensors``, as ``vitflow export --format hub`` writes), or, with
            ``model_name``, plain weights loaded by
            ``create_model(model_name, pretrained=spec, num_classes=0)``.
        model_name: the architecture of plain weights (a name of ``vitflow models``).
        weights: checkpoints: ``auto`` (EMA when saved), ``ema`` or ``raw``.
    Raises:
        FileNotFoundError: no such file or folder. ValueError: not a checkpoint and no
        ``model_name``; unreadable or incompatible weights (named).
    """
    p = Path(spec)
    if model_name is not None or str(spec).startswith("hf-hub:"):
        return load_plain_weights(spec, model_name)
    if p.is_dir() and foreign_snapshot(p):
        return load_plain_weights(spec, None)
    if is_hub_folder(p):
        hub = read_hub_folder(p)
        return Backbone(hub.model, hub.preprocess, hub.classes, str(p), hub.name)
    if not p.exists():
        raise FileNotFoundError(f"no such run directory, checkpoint or model folder: {p}")
    try:
        state = load_checkpoint(p)
    except (FileNotFoundError, ValueError):
        raise ValueError(f"{p} is not a vitflow run directory or checkpoint; for plain weights name the "
                         f"architecture: --model NAME (a folder with {CONFIG_NAME} is read as a model folder)") from None
    model = model_from_checkpoint(state, weights)
    return Backbone(model, Preprocess.from_dict(state["preprocess"]), list(state["classes"]), state["path"],
                    state["model_args"]["name"], state["config"])


def foreign_snapshot(folder: Path) -> bool:
    """A snapshot folder that is not a hub-style folder vitflow or timm wrote with its full model
    arguments (a transformers or OpenCLIP config, or a timm config naming only the architecture):
    the model layer's resolver reads it."""
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return (folder / "open_clip_config.json").is_file()
    return not isinstance(config, dict) or not ("vitflow" in config or "model_args" in config)


def load_plain_weights(spec: str | Path, model_name: str | None, head: bool = False) -> Backbone:
    """A headless backbone from weights (:func:`vitflow.models.pretrained.hub.resolve_pretrained`): a weights
    file, a snapshot folder (timm, transformers or OpenCLIP config) or an ``hf-hub:`` name. The
    architecture is ``model_name`` or, without it, the one the snapshot's config names; the
    preprocessing is the one saved with the weights (mean, std, size, crop, interpolation), else
    :func:`default_preprocess`. ``head``: keep the weights' classifier (``classes``: their label
    names) instead of a headless backbone.

    Raises:
        ValueError: no ``model_name`` and no config naming an architecture; weights that do not
        fit. FileNotFoundError: no such file.
    """
    if model_name is None:
        size = (resolve_pretrained(str(spec)).preprocess or {}).get("input_size")
        size = size[-1] if isinstance(size, (list, tuple)) else size  # the weights' input size, as training takes it
        try:
            model, pre = create_pretrained_model(str(spec), **({} if head else {"num_classes": 0}),
                                                 **({"img_size": int(size)} if size else {}))
        except ValueError as e:
            raise ValueError(f"{e}; or name the architecture of these weights with --model NAME "
                             "(see `vitflow models`)") from None
        model_name = pre.model_name
    else:
        pre = resolve_pretrained(str(spec))
        model = create_model(model_name, pretrained=str(spec), **({} if head else {"num_classes": 0}))
    model.eval()
    pp = default_preprocess(model)
    if pre.preprocess:
        w = pre.preprocess
        pp = Preprocess(int(getattr(model, "img_size", pp.image_size)), float(w.get("crop_pct", pp.crop_pct)),
                        w.get("interpolation") if w.get("interpolation") in ("bilinear", "bicubic") else pp.interpolation,
                        tuple(w.get("mean", pp.mean)), tuple(w.get("std", pp.std)))
        log.info("%s: preprocessing saved with the weights: %s", spec, pp)
    else:
        log.info("%s: no preprocessing saved with the weights; using %s", spec, pp)
    return Backbone(model, pp, pre.label_names, str(spec), model_name)
