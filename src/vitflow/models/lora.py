"""LoRA: low-rank adapters on a model's linear layers (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"; the reference implementation is microsoft/LoRA's
``loralib``, the same rule as Hugging Face ``peft``).

A layer ``y = x W^T + b`` (``W`` of shape ``(out, in)``) becomes

    ``y = x W^T + b + (alpha / r) * B (A (dropout(x)))``,   ``A (r, in)``, ``B (out, r)``

with ``W`` and ``b`` frozen and only ``A`` and ``B`` trained. ``A`` starts Kaiming-uniform (as an
``nn.Linear`` weight), ``B`` at zero, so the adapted model starts equal to the base model.
:func:`merge_lora` folds ``(alpha / r) B A`` into ``W`` and gives back plain linear layers: the
merged model is an ordinary model of its family (export, INT8, pruning, timm all see plain
weights).

Layers are found by module name (``targets``: ``attn.qkv``, ``attn.proj``, ``mlp.fc1``,
``mlp.fc2`` in every family that uses timm's names), not by class, so any family whose
projections are linear layers takes adapters. State-dict names: the base layer keeps its own
(``blocks.0.attn.qkv.weight``, ``.bias``: pretrained weights load unchanged) and the adapters
add ``blocks.0.attn.qkv.lora_A`` and ``.lora_B``. A checkpoint's ``model_args`` carry the
adapter configuration under ``"lora"`` (:func:`split_lora_args`).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.kernels.matmul import Linear

DEFAULT_TARGETS = ("attn.qkv", "attn.proj")
LORA_KEYS = ("rank", "alpha", "dropout", "targets")


class LoRALinear(Linear):
    """A :class:`~vitflow.models.kernels.matmul.Linear` plus a trainable low-rank update (see the module
    docstring). It shares (does not copy) the base layer's ``weight`` and ``bias``.

    Args:
        base: the linear layer to adapt (an ``nn.Linear`` or vitflow ``Linear``).
        rank: ``r``, the adapters' inner width (>= 1).
        alpha: the scale numerator; the update is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapter branch's input (training only).

    Shapes: ``x (..., in)`` [``residual (..., out)``] -> ``(..., out)``, any float dtype.
    Raises:
        ValueError: ``rank < 1``, ``alpha <= 0`` or ``dropout`` outside ``[0, 1)``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        if rank < 1 or alpha <= 0 or not 0 <= dropout < 1:
            raise ValueError(f"LoRA needs rank >= 1, alpha > 0 and dropout in [0, 1), got rank={rank}, "
                             f"alpha={alpha}, dropout={dropout}")
        w = base.weight
        super().__init__(base.in_features, base.out_features, base.bias is not None,
                         gemm=getattr(base, "gemm", "auto"), device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's init, as loralib / peft
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x, residual)
        return y + self.scaling * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        """``(alpha / r) B A``, shape ``(out, in)``, computed in float32 (float64 for float64
        weights), in the weight's dtype."""
        dt = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        return (self.scaling * (self.lora_B.to(dt) @ self.lora_A.to(dt))).to(self.weight.dtype)

    def merged(self) -> Linear:
        """A plain :class:`~vitflow.models.kernels.matmul.Linear` with weight ``W + (alpha / r) B A``
        and the same bias (new parameters; ``requires_grad`` as the base weight's)."""
        w = self.weight
        out = Linear(self.in_features, self.out_features, self.bias is not None, gemm=self.gemm, device="meta")
        out.weight = nn.Parameter((w.detach() + self.delta_weight().detach()).clone(), requires_grad=w.requires_grad)
        out.bias = None if self.bias is None else nn.Parameter(self.bias.detach().clone(),
                                                               requires_grad=self.bias.requires_grad)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lora_rank={self.rank}, lora_alpha={self.alpha:g}"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target) or fnmatch.fnmatchcase(name, target)


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: Sequence[str] = DEFAULT_TARGETS) -> list[str]:
    """Replace (in place) every linear layer of ``model`` whose module name matches one of
    ``targets`` by a :class:`LoRALinear` around it; returns the adapted modules' names.

    A target matches a module name exactly, as its dotted suffix (``attn.qkv`` matches
    ``blocks.3.attn.qkv``) or as a shell-style pattern (``blocks.1[01].mlp.*``). Only
    ``nn.Linear`` instances (vitflow's ``Linear`` included) are adapted; layers already adapted
    are left as they are. The adapters' initialisation draws from torch's global RNG (``A``).
    Nothing is frozen here: the trainer decides what trains.

    Raises:
        ValueError: no linear layer matches ``targets`` (the message lists the model's linear
            layer names of the first block), or bad ``rank`` / ``alpha`` / ``dropout``.
    """
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)
             and any(_matches(name, t) for t in targets)]
    if not found:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        shown = [n for n in linear if n.startswith("blocks.0.")] or linear[:6]
        raise ValueError(f"LoRA targets {list(targets)} match no linear layer of {type(model).__name__} "
                         f"(its linear layers include {shown})")
    for name, m in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child,
                LoRALinear(m, rank, alpha, dropout))
    return [name for name, _ in found]


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every :class:`LoRALinear` of ``model`` into a plain ``Linear`` with weight
    ``W + (alpha / r) B A`` (in place); returns ``model``. Outputs are those of the adapted model
    in eval mode up to float rounding (~1e-6 relative in float32); a model without adapters is
    returned unchanged."""
    for name, m in list(model.named_modules()):
        if isinstance(m, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, m.merged())
    return model


def merge_lora_state_dict(state_dict: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A state dict with its unmerged adapters folded into the base weights (``W + (alpha / r) B A``,
    ``r`` read from ``A``'s shape) and the ``lora_A`` / ``lora_B`` entries dropped: what a
    weights loader reads from a LoRA-trained vitflow checkpoint (its ``model_args["lora"]["alpha"]``).

    Raises:
        ValueError: an adapter without its pair or its base ``.weight``.
    """
    out = {k: v for k, v in state_dict.items() if not is_lora_parameter(k)}
    for key, a in state_dict.items():
        if not key.endswith("lora_A"):
            continue
        prefix = key[: -len("lora_A")]
        b, w = state_dict.get(prefix + "lora_B"), out.get(prefix + "weight")
        if b is None or w is None:
            raise ValueError(f"LoRA adapter {key} has no {prefix + 'lora_B' if b is None else prefix + 'weight'}")
        dt = torch.float64 if w.dtype == torch.float64 else torch.float32
        out[prefix + "weight"] = (w.to(dt) + (alpha / a.shape[0]) * (b.to(dt) @ a.to(dt))).to(w.dtype)
    return out


def is_lora_parameter(name: str) -> bool:
    """Whether state-dict / parameter name ``name`` is a LoRA adapter (``*.lora_A`` / ``*.lora_B``)."""
    return name.endswith((".lora_A", ".lora_B")) or name in ("lora_A", "lora_B")


def has_lora_weights(state_dict: dict[str, Any]) -> bool:
    """Whether a state dict holds unmerged LoRA adapters."""
    return any(is_lora_parameter(k) for k in state_dict)


def lora_args(rank: int, alpha: float, dropout: float, targets: Sequence[str]) -> dict[str, Any]:
    """The ``"lora"`` entry of a checkpoint's ``model_args`` (plain types: JSON / YAML safe)."""
    return {"rank": int(rank), "alpha": float(alpha), "dropout": float(dropout), "targets": list(targets)}


def split_lora_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(create_model arguments without "lora", the LoRA configuration or None)``: a
    checkpoint's ``model_args`` split for :func:`vitflow.create_model` and :func:`apply_lora`.

    Raises:
        ValueError: a ``"lora"`` entry with keys other than ``rank``, ``alpha``, ``dropout``,
            ``targets``.
    """
    args = dict(args)
    lora = args.pop("lora", None)
    if lora is not None and set(lora) - set(LORA_KEYS):
        raise ValueError(f"model_args lora has unknown keys {sorted(set(lora) - set(LORA_KEYS))}; "
                         f"expected {list(LORA_KEYS)}")
    return args, lora
