"""Classification and distillation losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy with label smoothing (Szegedy et al. 2016, sec. 7).

    Args:
        logits: ``(B, C)`` any float dtype (computed in float32).
        targets: class indices ``int64 (B,)``, or soft targets ``float (B, C)`` summing to 1 per
            row, such as Mixup/CutMix produce unsmoothed. Smoothing is applied here, once, in
            both cases: the target becomes ``(1 - eps) * t + eps / C``
            (:func:`torch.nn.functional.cross_entropy` semantics).
    Returns:
        A float32 scalar.
    """
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)


def soft_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Knowledge distillation (Hinton et al. 2015): ``tau**2 * KL(softmax(teacher / tau) ||
    softmax(student / tau))``, averaged over the batch. The ``tau**2`` keeps gradient magnitudes
    independent of the temperature. (DeiT divides the summed KL by ``B * C`` instead of ``B``;
    this is the per-sample KL of the original paper.)

    Args:
        student, teacher: logits ``(B, C)``, any float dtype (computed in float32); no gradient
            flows into ``teacher``.
    Returns:
        A float32 scalar >= 0.
    """
    s = F.log_softmax(student.float() / tau, dim=1)
    t = F.log_softmax(teacher.detach().float() / tau, dim=1)
    return F.kl_div(s, t, reduction="batchmean", log_target=True) * tau * tau


def hard_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """DeiT's hard-label distillation (Touvron et al. 2021, sec. 5.2): cross-entropy of the
    student against the teacher's argmax, ``(B, C), (B, C) -> float32 scalar``."""
    return F.cross_entropy(student.float(), teacher.detach().argmax(dim=1))
