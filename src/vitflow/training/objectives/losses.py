"""Classification and distillation losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0,
                        weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy with label smoothing (Szegedy et al. 2016, sec. 7).

    Args:
        logits: ``(B, C)`` any float dtype (computed in float32).
        targets: class indices ``int64 (B,)``, or soft targets ``float (B, C)`` summing to 1 per
            row, such as Mixup/CutMix produce unsmoothed. Smoothing is applied here, once, in
            both cases: the target becomes ``(1 - eps) * t + eps / C``
            (:func:`torch.nn.functional.cross_entropy` semantics).
        weight: per-class weights ``float32 (C,)`` (``train.class_weights``; see
            :mod:`vitflow.training.objectives.class_weights`), ``cross_entropy(weight=...)`` semantics; ``None``: none.
    Returns:
        A float32 scalar.
    """
    return F.cross_entropy(logits.float(), targets, weight=weight, label_smoothing=label_smoothing)


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


def multilabel_loss(logits: torch.Tensor, targets: torch.Tensor, kind: str = "bce", gamma_neg: float = 4.0,
                    gamma_pos: float = 0.0, clip: float = 0.05, pos_weight: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Multi-label classification loss: an independent binary problem per label.

    ``kind="bce"``: binary cross-entropy with logits,
    ``-[t log p + (1 - t) log(1 - p)]`` with ``p = sigmoid(logit)``, averaged over all ``B * C``
    elements (:func:`torch.nn.functional.binary_cross_entropy_with_logits`).

    ``kind="asl"``: the asymmetric loss of Ridnik et al. 2021 ("Asymmetric Loss For Multi-Label
    Classification", ICCV, eq. 4 with probability shifting):
    ``-[t (1 - p)^gamma_pos log(p) + (1 - t) p_m^gamma_neg log(1 - p_m)]`` with
    ``p_m = max(p - clip, 0)``, also averaged over all ``B * C`` elements. The paper (and its code)
    sums instead; the mean, like the BCE one, keeps the loss on the same scale as BCE, so that a
    learning rate tuned with one suits the other. With ``gamma_neg = gamma_pos = clip = 0`` it equals
    BCE. Negatives with ``p <= clip`` contribute nothing (hard thresholding of easy negatives).
    Gradients flow through the focusing weights ``(1 - p)^gamma_pos`` and ``p_m^gamma_neg``, as in
    the paper's formula and in focal loss; the paper's code by default treats them as constants in
    the backward pass (``disable_torch_grad_focal_loss=True``), which this function does not do.
    For soft targets the two terms are weighted by ``t`` and ``1 - t`` as written above (the
    paper's code instead mixes the focusing weights of the two terms); for 0/1 targets both agree.

    Numerically stable: computed in float32 from log-sigmoids, so logits of +-50 and beyond give
    finite values and gradients.

    Args:
        logits: ``(B, C)`` any float dtype (computed in float32).
        targets: float ``(B, C)`` in [0, 1]: multi-hot labels, or soft ones after Mixup/CutMix.
        kind: ``"bce"`` or ``"asl"``; ``gamma_neg``, ``gamma_pos`` (>= 0) and ``clip`` (in [0, 1))
            only apply to ``"asl"`` (defaults: the paper's, except ``gamma_pos`` 0 instead of 1).
        pos_weight: ``"bce"`` only: weight of each class's positive term ``float32 (C,)``
            (``train.class_weights``), as in ``binary_cross_entropy_with_logits``.
    Returns:
        A float32 scalar.
    Raises:
        ValueError: for an unknown ``kind``, a negative gamma, a ``clip`` outside [0, 1), or
            targets of another shape than the logits.
    """
    if kind not in ("bce", "asl"):
        raise ValueError(f"unknown multi-label loss kind {kind!r}; expected 'bce' or 'asl'")
    if targets.shape != logits.shape:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
    x, t = logits.float(), targets.float()
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(x, t, pos_weight=pos_weight)
    if gamma_neg < 0 or gamma_pos < 0 or not 0 <= clip < 1:
        raise ValueError(f"ASL needs gamma_neg, gamma_pos >= 0 and 0 <= clip < 1, got {gamma_neg}, {gamma_pos}, {clip}")
    positive = t * torch.exp(gamma_pos * F.logsigmoid(-x)) * F.logsigmoid(x)  # (1 - p)^g log p
    return -(positive + (1 - t) * _asl_negative_term(x, gamma_neg, clip)).mean()


def _asl_negative_term(x: torch.Tensor, gamma: float, clip: float) -> torch.Tensor:
    """``p_m^gamma * log(1 - p_m)`` with ``p_m = max(sigmoid(x) - clip, 0)``, without NaN or inf in
    the value or the gradient."""
    if clip == 0:  # p_m = p: log-sigmoid forms
        return torch.exp(gamma * F.logsigmoid(x)) * F.logsigmoid(-x)
    p_m = (torch.sigmoid(x) - clip).clamp(min=0)
    log_1m = torch.log1p(-p_m)  # 1 - p_m >= clip > 0
    if gamma == 0:
        return log_1m
    # p_m^gamma, with a zero gradient (not 0 * inf) where p_m = 0 and gamma < 1
    weight = torch.where(p_m > 0, p_m.clamp(min=torch.finfo(p_m.dtype).tiny) ** gamma, torch.zeros_like(p_m))
    return weight * log_1m
