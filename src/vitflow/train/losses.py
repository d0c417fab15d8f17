"""Classification losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy with label smoothing (Szegedy et al. 2016, sec. 7).

    Args:
        logits: ``(B, C)`` any float dtype (computed in float32).
        targets: class indices ``int64 (B,)`` or soft targets ``float (B, C)`` summing to 1 per row
            (smoothing is then applied to them once: ``(1 - eps) * t + eps / C``).
    Returns:
        A float32 scalar.
    """
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)


@torch.no_grad()
def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> list[int]:
    """Number of rows whose label is among the top-``k`` logits, for each ``k`` (``k`` capped at
    the class count). ``logits (B, C)``, ``labels int64 (B,)``."""
    maxk = min(max(ks), logits.shape[1])
    top = logits.topk(maxk, dim=1).indices
    hit = top == labels.unsqueeze(1)
    return [int(hit[:, :min(k, maxk)].any(dim=1).sum()) for k in ks]
