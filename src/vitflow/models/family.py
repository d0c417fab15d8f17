"""A model family: one architecture, its named variants, how to build one and how to load
foreign weights into it. :mod:`vitflow.models.registry` finds the family that owns a name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class ModelFamily:
    """One architecture's entry in the registry.

    Attributes:
        name: the family's name (``"vit"``), shown by ``vitflow models``.
        description: one line: the architecture and its paper.
        variants: variant name -> constructor arguments (e.g. ``{"embed_dim": 384, ...}``).
        build: constructor arguments -> a model with ``forward_features`` / ``forward_head``.
        load_pretrained: ``(model, spec)`` -> None, loading weights into a built model: a file, a
            snapshot folder or ``hf-hub:ORG/NAME[@rev]`` (the generic
            :func:`vitflow.models.pretrained.weights.load_pretrained` for every family with timm's names;
            raises ValueError for weights that do not fit), or ``None`` when the family reads no
            foreign weights.
        summary: variant arguments -> a short column text for ``vitflow models``.
    """

    name: str
    description: str
    variants: dict[str, dict[str, Any]]
    build: Callable[..., nn.Module]
    load_pretrained: Callable[[nn.Module, str | Path], None] | None = None
    summary: Callable[[dict[str, Any]], str] = lambda args: ""
