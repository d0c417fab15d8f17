"""Gated MLPs of EVA-02 and DINOv3: SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"),
``silu(x W_g) * (x W_x)`` then ``W_2``, with an optional LayerNorm on the hidden units before
``W_2`` (EVA-02's sub-LN / NormFormer "scale MLP", Shleifer et al. 2021). Parameter names follow
timm: ``mlp.fc1`` (gate and value packed, gate first) / ``mlp.fc2`` for :class:`PackedSwiGLU`
(timm's ``GluMlp``), ``mlp.fc1_g``, ``mlp.fc1_x``, ``mlp.norm``, ``mlp.fc2`` for :class:`SwiGLU`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.kernels.matmul import Linear


class PackedSwiGLU(nn.Module):
    """SwiGLU with one packed input projection ``fc1: D -> 2*hidden`` (first half the gate).

    ``(B, N, D) -> (B, N, D)``; ``hidden`` is the width after gating (timm's ``GluMlp`` with
    ``hidden_features = 2 * hidden``, ``gate_last=False``, SiLU).
    """

    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = Linear(dim, 2 * hidden)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.drop2(self.fc2(self.drop1(self.act(gate) * value)))


class SwiGLU(nn.Module):
    """SwiGLU with separate gate and value projections ``fc1_g``, ``fc1_x: D -> hidden`` and, with
    ``norm_eps``, a LayerNorm over the hidden units (sub-LN) before ``fc2: hidden -> D``.

    ``hidden`` is rounded up to a multiple of ``align_to`` when given (DINOv3's ``swiglu_align_to``).
    ``(B, N, D) -> (B, N, D)``.
    """

    def __init__(self, dim: int, hidden: int, drop: float = 0.0, norm_eps: float | None = None, align_to: int = 0):
        super().__init__()
        if align_to:
            hidden += -hidden % align_to
        self.fc1_g = Linear(dim, hidden)
        self.fc1_x = Linear(dim, hidden)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps is not None else nn.Identity()
        self.fc2 = Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.fc1_g(x)) * self.fc1_x(x)
        return self.drop2(self.fc2(self.norm(self.drop1(h))))
