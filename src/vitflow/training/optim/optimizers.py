"""Optimizers and their parameter groups: no weight decay on norms, biases, position embedding
and tokens; layer-wise learning-rate decay for fine-tuning. Schedules: :mod:`vitflow.training.optim.schedules`."""

from __future__ import annotations

import torch

from vitflow.config import OptimConfig


def layer_id(name: str, depth: int) -> int:
    """Depth of parameter ``name`` for layer-wise lr decay (BEiT, Bao et al. 2022): 0 for the
    patch embedding, position embedding, class / distillation / register tokens and the
    pre-block norm (CLIP's ``norm_pre``), ``i + 1`` for ``blocks.i.*``, ``depth + 1`` for
    everything after the blocks (final norm, attention pool, heads)."""
    if name.startswith(("patch_embed", "pos_embed", "cls_token", "dist_token", "reg_token", "norm_pre")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def param_groups(model: torch.nn.Module, weight_decay: float, lr: float = 1.0,
                 layer_decay: float | None = None) -> list[dict]:
    """Parameter groups for the optimizer.

    Weight decay applies to weight matrices / kernels only; norms, biases (all 1-D parameters)
    and the names in ``model.no_weight_decay()`` (position embedding, class token) get none.
    With ``layer_decay = d`` (BEiT-style fine-tuning), a parameter of :func:`layer_id` ``i`` in a
    model of ``D`` blocks (a model's own ``layer_id(name)`` if it has one: Swin's stages) gets learning rate ``lr * d ** (D + 1 - i)``: the head trains at
    ``lr``, the embeddings at ``lr * d ** (D + 1)``. Each group records its ``lr_scale``.

    Returns:
        Non-empty groups ``{"params", "weight_decay", "lr", "lr_scale"}``; without layer decay the
        decayed group first, then the undecayed one.
    """
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    depth = len(getattr(model, "blocks", ()))
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip
        depth_id = (getattr(model, "layer_id", None) or (lambda n: layer_id(n, depth)))(name) if layer_decay is not None \
            else 0
        scale = layer_decay ** (depth + 1 - depth_id) if layer_decay is not None else 1.0
        group = groups.setdefault((depth_id, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                         "lr": lr * scale, "lr_scale": scale})
        group["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def fused_supported(params) -> bool:
    """True when torch's fused (single-kernel, all parameters at once) AdamW / SGD step can run
    over ``params``: plain floating-point tensors (not DTensor shards) on one device type that
    has fused kernels (the CPU included since torch 2.4)."""
    try:  # torch's own list (private): cpu, cuda, mps, xpu, ... in torch 2.4+
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as supported_devices
    except ImportError:
        def supported_devices() -> list[str]:
            return ["cuda"]
    params = list(params)
    return bool(params) and all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params) \
        and len({p.device.type for p in params}) == 1 and params[0].device.type in supported_devices()


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) or SGD with Nesterov momentum (Sutskever et al. 2013),
    over :func:`param_groups` (with ``optim.layer_decay`` when set).

    The step is torch's fused implementation wherever :func:`fused_supported` holds: the same
    update rule, but one kernel over all parameters instead of a loop over them (on the CPU torch
    otherwise falls back to that per-tensor loop; fused is ~3-4x faster there: 2.3 vs 9.4 ms per
    AdamW step for the CIFAR ViT, 19 vs 62 ms for ViT-S/16 on a 2-core AVX-512 CPU).
    FSDP-sharded (DTensor) parameters keep torch's default implementation.
    """
    groups = param_groups(model, cfg.weight_decay, cfg.lr, cfg.layer_decay)
    fused = fused_supported(p for g in groups for p in g["params"]) or None
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0, fused=fused)
