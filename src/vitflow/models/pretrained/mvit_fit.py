"""Fit MViTv2 weights (timm's names) to a model of another input size or class count at load time.

Each block's ``attn.rel_pos_h`` / ``attn.rel_pos_w`` has ``2 max(q, kv) - 1`` rows for the grids
of the image size it was built for; a model built for another size gets them linearly resampled
to its own rows (timm's ``checkpoint_filter_fn``: ``F.interpolate(mode="linear")``; the same
rule the model applies at run time to grids it was not built for), one log line per change,
e.g. ``rel_pos_h/w: 111 -> 127 rows (resampled) in 1 blocks``. A head of another class count
is dropped (``head reset: 1000 -> 5 classes``).

:func:`adapt_mvit_state_dict` is what :func:`vitflow.models.pretrained.weights.adapt_state_dict`
calls for an MViT model (:func:`is_mvit_model`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Mapping

import torch
import torch.nn as nn

from vitflow.models.attention.pooling import resample_rel_pos

log = logging.getLogger(__name__)

_MVIT_KEY = re.compile(r"^stages\.\d+\.blocks\.\d+\.attn\.(rel_pos_h|pool_q\.weight|qkv\.weight)$")


def is_mvit_model(model: nn.Module) -> bool:
    """True for an MViTv2 with timm's names (``stages.{i}.blocks.{j}.attn`` with relative tables or
    pooling convolutions)."""
    return any(_MVIT_KEY.match(k) for k in model.state_dict()) and any(".attn.pool_" in k or ".rel_pos_h" in k
                                                                        for k in model.state_dict())


def adapt_mvit_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Fit an MViTv2 state_dict in timm's names to ``model``: relative tables resampled to the
    model's rows, a head of another class count dropped; each change logged.

    Returns:
        a new dict (the input is not modified).
    """
    own = model.state_dict()
    sd = dict(state_dict)
    changes: Counter = Counter()
    for key in [k for k in sd if k.endswith((".rel_pos_h", ".rel_pos_w")) and k in own]:
        rows, want = sd[key].shape[0], own[key].shape[0]
        if rows != want and sd[key].shape[1:] == own[key].shape[1:]:
            sd[key] = resample_rel_pos(sd[key], want)
            changes[(rows, want)] += 1
    for (old, new), n in sorted(changes.items()):
        log.info("rel_pos_h/w: %d -> %d rows (resampled) in %d blocks", old, new, n // 2)
    head = sd.get("head.fc.weight")
    if head is not None and (own.get("head.fc.weight") is None or head.shape != own["head.fc.weight"].shape):
        log.info("head reset: %d -> %d classes", head.shape[0], getattr(model, "num_classes", 0))
        sd = {k: v for k, v in sd.items() if not k.startswith("head.fc.")}
    return sd
