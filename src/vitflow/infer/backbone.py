"""A model for frozen-feature work (``vitflow embed``, ``vitflow eval --knn``), from what the user has:
a vitflow run directory or checkpoint, a hub-style folder (:mod:`vitflow.infer.hub_folder`), or plain
weights with the architecture named.

:func:`load_backbone` is the one place a weights spec becomes a model and its preprocessing; the
resolution of foreign snapshot folders and ``hf-hub:`` names belongs to the model layer's loader
(``create_model(name, pretrained=spec)``), which this module calls for plain weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.data.transforms import Preprocess
from vitflow.infer.hub_folder import CONFIG_NAME, is_hub_folder, read_hub_folder
from vitflow.models import create_model

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
    if is_hub_folder(p):
        hub = read_hub_folder(p)
        return Backbone(hub.model, hub.preprocess, hub.classes, str(p), hub.name)
    if not p.exists():
        raise FileNotFoundError(f"no such run directory, checkpoint or model folder: {p}")
    try:
        state = load_checkpoint(p)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{e}; for plain weights name the architecture: --model NAME "
                         f"(a folder with {CONFIG_NAME} is read as a hub-style model folder)") from None
    model = model_from_checkpoint(state, weights)
    return Backbone(model, Preprocess.from_dict(state["preprocess"]), list(state["classes"]), state["path"],
                    state["model_args"]["name"], state["config"])


def load_plain_weights(spec: str | Path, model_name: str | None) -> Backbone:
    """A headless backbone from weights: ``create_model(model_name, pretrained=spec, num_classes=0)``
    with :func:`default_preprocess`.

    This is where the model layer's weight resolution plugs in (snapshot folders, ``hf-hub:``
    names, ``model.name=auto``, the preprocessing saved with the weights): today ``spec`` is a
    weights file the model family reads, and ``model_name`` is required.

    Raises:
        ValueError: no ``model_name``; weights that do not fit. FileNotFoundError: no such file.
    """
    if model_name is None:
        raise ValueError(f"{spec}: name the architecture of these weights with --model NAME (see `vitflow models`)")
    model = create_model(model_name, pretrained=str(spec), num_classes=0).eval()
    pp = default_preprocess(model)
    log.info("%s: no preprocessing saved with the weights; using %s", spec, pp)
    return Backbone(model, pp, None, str(spec), model_name)
