"""A model family: one architecture, its named variants, its section of the config, how to build
one and how to load foreign weights into it. :mod:`vitflow.models.registry` finds the family that
owns a name."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from vitflow.config import ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    """One architecture's entry in the registry.

    Attributes:
        name: the family's name (``"vit"``), shown by ``vitflow models``.
        description: one line: the architecture and its paper.
        variants: variant name -> constructor arguments (e.g. ``{"embed_dim": 384, ...}``).
        build: constructor arguments -> a model with ``forward_features`` / ``forward_head``. It
            receives the keys of ``config`` (but ``name`` / ``pretrained``) and the variant's
            arguments: :func:`vitflow.create_model` has refused every other key.
        load_pretrained: ``(model, spec)`` -> None, loading weights into a built model: a file, a
            snapshot folder or ``hf-hub:ORG/NAME[@rev]`` (the generic
            :func:`vitflow.models.pretrained.weights.load_pretrained` for every family with timm's names;
            raises ValueError for weights that do not fit), or ``None`` when the family reads no
            foreign weights.
        summary: variant arguments -> a short column text for ``vitflow models``.
        config: the family's ``model`` section (a class of :mod:`vitflow.config.model_schema`): the
            ``model.*`` keys it takes; ``build_config`` refuses the others.
        arguments: what ``build`` takes beyond ``config``'s keys and the variants' (the model's
            other constructor arguments, e.g. ``in_chans``), for Python callers of ``create_model``.
        check_config: the family's checks of its section that need the model layer (raises
            ``ConfigError`` naming the key), run by :func:`vitflow.models.check_config`, or None.
    """

    name: str
    description: str
    variants: dict[str, dict[str, Any]]
    build: Callable[..., nn.Module]
    load_pretrained: Callable[[nn.Module, str | Path], None] | None = None
    summary: Callable[[dict[str, Any]], str] = lambda args: ""
    config: type[ModelConfig] = ModelConfig
    arguments: frozenset[str] = frozenset()
    check_config: Callable[[Any], None] | None = None

    def accepts(self) -> set[str]:
        """Every argument ``build`` takes: the config's keys (but ``name`` / ``pretrained``), the
        variants' arguments and :attr:`arguments`."""
        keys = {f.name for f in fields(self.config) if f.name not in ("name", "pretrained")}
        return keys | set(self.arguments) | {k for args in self.variants.values() for k in args}


def constructor(model_cls: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A family's ``build``: ``model_cls(**kwargs)`` (the variant's arguments and the config's keys),
    then ``grad_checkpointing`` and its budget set on the model (``set_grad_checkpointing``)."""

    def build(grad_checkpointing: str | bool = "none", grad_checkpointing_budget: str | int | None = None,
              **kwargs: Any) -> nn.Module:
        model = model_cls(**kwargs)
        model.set_grad_checkpointing(grad_checkpointing, grad_checkpointing_budget)
        return model

    build.__doc__ = (f"A :class:`{model_cls.__module__}.{model_cls.__qualname__}` from its variant's arguments and "
                     "the config's keys, gradient checkpointing set. Raises ValueError for bad arguments.")
    return build
