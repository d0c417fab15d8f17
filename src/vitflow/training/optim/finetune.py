"""Fine-tuning a pretrained backbone: which weights train (config section ``finetune``).

Modes (``finetune.mode``):

``full``          every weight trains (the default; with ``optim.layer_decay`` the BEiT-style
                  layer-wise lr decay of :func:`vitflow.training.optim.optimizers.param_groups`). Partial
                  freezing: ``finetune.freeze_patch_embed`` freezes the patch embedding, the
                  position embedding and the class / register / distillation tokens (layer 0 of
                  the lr decay); ``finetune.freeze_blocks = K`` freezes ``blocks.0 .. blocks.K-1``.
``linear_probe``  the backbone is frozen; only the classifier (``head``, ``head_dist``) trains.
``lp_ft``         LP-FT (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained Features and
                  Underperform Out-of-Distribution"): a linear probe for the first
                  ``finetune.probe_steps`` steps (a step count, or a fraction of
                  ``train.total_steps``), then everything but the partially frozen weights trains.
``lora``          LoRA adapters (Hu et al. 2021; :mod:`vitflow.models.lora`) on the layers
                  ``finetune.lora_targets`` names, plus the head, train; every other weight is frozen.

Frozen parameters have ``requires_grad = False`` (parameters a model freezes itself, e.g. a fixed
sin-cos position embedding, stay frozen in every mode): they get no gradient and no optimizer state
(AdamW / SGD skip parameters without a gradient, weight decay included), and the backward pass
stops at the first trainable layer. The models have no BatchNorm, so nothing runs in eval mode
differently: dropout and stochastic depth stay active in frozen blocks.

LP-FT, the switch and its schedule: the optimizer is built once, over the parameters of the
second phase (with their layer-decay groups), while the first phase leaves the backbone
without gradients; at step ``S = probe_end`` the backbone's ``requires_grad`` is set and its
optimizer state begins there (AdamW's step count and bias correction start at 0 for those
parameters). The learning-rate schedule runs twice (:class:`~vitflow.training.optim.schedules.Schedule`
``restart = S``): over steps ``[0, S)`` the configured warmup and decay fit the probe phase;
from ``S`` the warmup (``optim.warmup_steps``) starts again, then the decay over
``[S, train.total_steps)``, so the backbone joins at a warmed-up, not a peak, learning rate.
``S`` is resolved once against ``train.total_steps``; a time budget that shortens the run
stretches only the second phase (or ends the run before ``S``). The phase is a function of the
step alone and the optimizer / scheduler states are the checkpoint's, so a run killed and
resumed before or after the switch ends bit-identical to an uninterrupted one. With several
ranks (DDP / FSDP), which fix the trained set when they wrap the model, ``lp_ft`` is refused.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch.nn as nn

from vitflow.config import FinetuneConfig
from vitflow.models import create_model
from vitflow.models.lora import apply_lora, is_lora_parameter, lora_args, split_lora_args
from vitflow.training.optim.optimizers import layer_id

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("head.", "head_dist.")  # the classifier(s), timm's names in every family


def is_head(name: str) -> bool:
    """Whether parameter ``name`` belongs to the classifier (``head``, ``head_dist``)."""
    return name.startswith(HEAD_PREFIXES)


class FineTuning:
    """The trainer's fine-tuning decisions (see the module docstring): builds the model (with
    LoRA adapters), freezes what the mode freezes at each step, logs each decision.

    Args:
        cfg: the ``finetune`` config section.
        total_steps: ``train.total_steps`` (resolves a fractional ``probe_steps``).
        world_size: ranks of the run.
    Raises:
        ValueError: ``lp_ft`` with several ranks.
    """

    def __init__(self, cfg: FinetuneConfig, total_steps: int, world_size: int = 1):
        self.cfg, self.mode = cfg, cfg.mode
        self.switch = cfg.probe_end(total_steps) if cfg.mode == "lp_ft" else None
        if self.switch is not None and world_size > 1:
            raise ValueError("finetune.mode=lp_ft is not supported with several ranks (DDP / FSDP fix the trained "
                             "parameters when they wrap the model); run it on one device or use full / linear_probe")
        self.probing: bool | None = None  # the phase last set (None: not yet)
        self.fixed: set[str] = set()  # parameters the model itself keeps frozen (never unfrozen here)
        self.counts = (0, 0)  # (trainable, all) parameters

    # -- the model -----------------------------------------------------------------------------

    def model_args(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` (a checkpoint's ``model_args``) plus the LoRA configuration in ``lora`` mode."""
        c = self.cfg
        return {**args, "lora": lora_args(c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_targets)} \
            if self.mode == "lora" else dict(args)

    def build(self, args: dict[str, Any], pretrained: str | None) -> nn.Module:
        """The model of ``args`` (:meth:`model_args`), its pretrained weights loaded, then the
        LoRA adapters added.

        Raises:
            ValueError: see :func:`vitflow.create_model`; LoRA targets that match no layer.
        """
        args, lora = split_lora_args(args)
        model = create_model(**args, pretrained=pretrained)
        if lora:
            try:
                names = apply_lora(model, **lora)
            except ValueError as e:
                raise ValueError(f"finetune.lora_targets: {e}") from None
            log.info("LoRA: rank %d, alpha %g (scale %g), dropout %g on %d linear layers matching %s", lora["rank"],
                     lora["alpha"], lora["alpha"] / lora["rank"], lora["dropout"], len(names), lora["targets"])
        return model

    # -- what trains ---------------------------------------------------------------------------

    def trains(self, name: str, depth: int, probing: bool) -> bool:
        """Whether parameter ``name`` trains in the given phase."""
        c = self.cfg
        if self.mode == "linear_probe" or probing:
            return is_head(name)
        if self.mode == "lora":
            return is_head(name) or is_lora_parameter(name)
        if c.freeze_patch_embed and layer_id(name, depth) == 0:
            return False
        return not (c.freeze_blocks and name.startswith("blocks.") and int(name.split(".")[1]) < c.freeze_blocks)

    def _apply(self, model: nn.Module, probing: bool) -> tuple[int, int]:
        depth = len(getattr(model, "blocks", ()))
        trained = total = 0
        for name, p in model.named_parameters():
            p.requires_grad_(name not in self.fixed and self.trains(name, depth, probing))
            total += p.numel()
            trained += p.numel() if p.requires_grad else 0
        return trained, total

    def set_phase(self, model: nn.Module, step: int) -> None:
        """Freeze / unfreeze ``model``'s parameters for ``step`` (cheap when the phase is
        unchanged); the first call and the LP-FT switch are logged.

        Raises:
            ValueError: ``freeze_blocks`` beyond the model's depth, or no head to train.
        """
        probing = self.switch is not None and step < self.switch
        if probing == self.probing:
            return
        first, self.probing = self.probing is None, probing
        if first:
            self._check(model)
            self.fixed = {n for n, p in model.named_parameters() if not p.requires_grad}
        self.counts = self._apply(model, probing)
        trained, total = self.counts
        share = f"{trained:,} of {total:,} parameters train ({trained / max(total, 1):.2%})"
        if not first:
            log.info("LP-FT switch at step %d: backbone unfrozen; %s", step, share)
            return
        log.info("fine-tuning: mode %s; %s frozen; %s", self.mode, self._frozen_text(probing), share)
        if self.switch is not None:
            log.info("LP-FT: the head alone trains for steps 0-%d, then everything%s from step %d; the lr schedule "
                     "runs over the probe and runs again (warmup included) from step %d", self.switch - 1,
                     " not frozen above" if self._partial() else "", self.switch, self.switch)

    def _partial(self) -> bool:
        return self.cfg.freeze_patch_embed or self.cfg.freeze_blocks > 0

    def _frozen_text(self, probing: bool) -> str:
        c = self.cfg
        if self.mode == "linear_probe" or probing:
            return "the backbone (all but the head)"
        if self.mode == "lora":
            return "every weight but the LoRA adapters and the head"
        parts = ["the patch embedding, position embedding and tokens"] if c.freeze_patch_embed else []
        if c.freeze_blocks:
            parts.append(f"blocks 0-{c.freeze_blocks - 1}")
        return "; ".join(parts) or "nothing"

    def _check(self, model: nn.Module) -> None:
        depth = len(getattr(model, "blocks", ()))
        if self.cfg.freeze_blocks > depth:
            raise ValueError(f"finetune.freeze_blocks={self.cfg.freeze_blocks} is invalid: the model has {depth} "
                             "blocks")
        if self.mode != "full" and not any(is_head(n) for n, _ in model.named_parameters()):
            raise ValueError(f"finetune.mode={self.mode}: the model has no classifier head to train "
                             f"(parameters named {', '.join(p.rstrip('.') for p in HEAD_PREFIXES)})")

    @contextlib.contextmanager
    def optimizing(self, model: nn.Module) -> Iterator[None]:
        """Within it, the parameters the optimizer must hold are trainable: for ``lp_ft`` those
        of the second phase (so that their groups exist from step 0), else the current phase's.
        The phase is restored on exit."""
        if self.switch is None or not self.probing:
            yield
            return
        self._apply(model, probing=False)
        try:
            yield
        finally:
            self._apply(model, probing=True)

    def summary(self) -> dict[str, Any]:
        """The run summary's fine-tuning entries: ``finetune`` (the mode), ``trainable_params``,
        ``total_params`` and, for LP-FT, ``probe_end_step``."""
        out: dict[str, Any] = {"finetune": self.mode, "trainable_params": self.counts[0],
                               "total_params": self.counts[1]}
        if self.switch is not None:
            out["probe_end_step"] = self.switch
        return out
