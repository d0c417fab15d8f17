"""A run carried on, not fine-tuned: ``model.pretrained=RUN`` where RUN is a from-scratch run of the
plan on the same data (train, ``vitflow inspect``, then train again with ``data.exclude``).

Such weights are not a backbone to fine-tune but the same training to carry on, so the plan keeps
its from-scratch recipe (planned for the new budget) in the run's architecture and on its split.
On a 20%-noisy CIFAR-10 folder of 10,000 images, 4 minutes of training, ``inspect`` and the rest of
10 minutes continued this way reached 51.3% test top-1, where a fine-tune's recipe there (batch 32,
lr 2e-4, layer decay 0.75, light crops) reached 45.4-46.8% in three runs
(``benchmarks/quality/clean_then_train.py``, an ``avx2`` CPU).
"""

from __future__ import annotations

import os
from typing import Any

from vitflow.config import DataConfig, ModelConfig, field_names
from vitflow.models import config_class
from vitflow.models.pretrained.hub import resolve_pretrained


def continued_run(m: ModelConfig, d: DataConfig, preset: str) -> dict[str, Any] | None:
    """The keys that carry ``model.pretrained`` on, or ``None`` when it is not a vitflow run or
    checkpoint of ``preset`` (the from-scratch plan: a run from scratch, or such a run continued)
    on the same ``data.path`` as ``d``.

    Returns:
        ``{"model.name": ..., "model.<key>": ...}`` for the run's architecture (sizes, patch,
        pooling, positions; not the class count) and ``data.train_split`` / ``data.val_split``
        as the run had them (the same images held out).
    Raises:
        FileNotFoundError, ValueError: as :func:`~vitflow.models.pretrained.hub.resolve_pretrained`.
    """
    spec = str(m.pretrained or "")
    if not spec or spec == "auto" or spec.startswith("hf-hub:"):
        return None
    pre = resolve_pretrained(spec)
    config = pre.config or {}
    data = config.get("data") or {}
    if config.get("preset") != preset or not same_path(data.get("path"), d.path):
        return None
    keys = set(field_names(config_class(pre.model_name)))
    return {"model.name": pre.model_name,
            **{f"model.{k}": v for k, v in pre.model_kwargs.items() if k in keys and k != "num_classes"},
            **{f"data.{k}": data[k] for k in ("train_split", "val_split") if data.get(k)}}


def same_path(a: str | None, b: str | None) -> bool:
    """Whether two ``data.path`` values name the same data (local paths after resolving links)."""
    if not a or not b:
        return False
    return a == b or ("://" not in a and "://" not in b and os.path.realpath(a) == os.path.realpath(b))
