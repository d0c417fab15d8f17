"""2-D rotary position embeddings (RoPE) for the patch grid, as EVA-02 and DINOv3 use them.

RoPE (Su et al. 2021, "RoFormer") rotates each pair of query / key channels by an angle that
grows with the token's position, so that ``q . k`` depends on the offset between two tokens. On
an image the channels of a head are split between the row and the column coordinate (axial 2-D
RoPE; Heo et al. 2024). Two variants, each matching timm's numerics (``RotaryEmbeddingCat`` with
``in_pixels=False`` for EVA-02, ``RotaryEmbeddingDinoV3`` for DINOv3):

- ``eva`` (EVA-02, Fang et al. 2023): integer coordinates ``0 .. s-1`` rescaled to the pretraining
  grid (``ref_grid``: ``x / s * ref``), frequencies ``temperature ** -(i / (d/4))``, interleaved pairs
  ``(x0, x1), (x2, x3), ...``;
- ``dinov3`` (Simeoni et al. 2025): centred coordinates ``2 (i + 0.5) / s - 1`` in ``[-1, 1]``,
  periods ``temperature ** (2 i / (d/2))``, angle ``2 pi x / period``, pairs ``(x_i, x_{i + d/2})``
  (the "rotate half" layout).

For either, the first ``d/2`` angles belong to the row coordinate and the last ``d/2`` to the
column. Prefix tokens (class, registers) are not rotated. The tables depend only on the grid, so
any input size gets its own, computed on first use and cached per (grid, device).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

ROPE_KINDS = ("eva", "dinov3")


def eva_angles(grid: tuple[int, int], head_dim: int, ref_grid: tuple[int, int] | None = None,
               temperature: float = 10000.0) -> torch.Tensor:
    """EVA-02 rotation angles ``(h*w, head_dim // 2)`` float32 for the patch grid ``(h, w)``, in
    timm's order of operations (``RotaryEmbeddingCat``, ``in_pixels=False``, ``ref_feat_shape``)."""
    bands = 1.0 / temperature ** (torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 4))
    axes = [torch.arange(s, dtype=torch.float32) for s in grid]
    if ref_grid is not None:
        axes = [a / s * r for a, s, r in zip(axes, grid, ref_grid)]
    coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)  # (h, w, 2)
    return (coords.unsqueeze(-1) * bands).flatten(-2).flatten(0, 1)


def dinov3_angles(grid: tuple[int, int], head_dim: int, temperature: float = 100.0) -> torch.Tensor:
    """DINOv3 rotation angles ``(h*w, head_dim // 2)`` float32 for the patch grid ``(h, w)``, in
    timm's order of operations (``RotaryEmbeddingDinoV3``, ``normalize_coords="separate"``)."""
    n = head_dim // 4
    periods = temperature ** (2.0 * torch.arange(n, dtype=torch.float32) / (head_dim // 2))
    axes = [torch.arange(0.5, s, dtype=torch.float32) / float(s) for s in grid]
    coords = 2.0 * torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1) - 1.0  # (h, w, 2) in [-1, 1]
    coords = coords.flatten(0, 1)
    return (2 * math.pi * coords[:, :, None] / periods[None, None, :]).flatten(1)


class Rope2d(nn.Module):
    """Axial 2-D RoPE applied to the packed qkv projection (no parameters; timm's module name
    ``rope``).

    Args:
        kind: ``"eva"`` or ``"dinov3"`` (see the module docstring).
        head_dim: channels per head (a multiple of 4).
        num_prefix_tokens: leading tokens left unrotated (class and register tokens).
        temperature: frequency base (EVA-02 10000, DINOv3 100).
        ref_grid: ``eva`` only: the pretraining grid coordinates are rescaled to.

    ``forward(qkv, num_heads, grid)``: packed ``(B, N, 3*H*d)`` (q, k, v heads-major, timm's
    layout) with ``N = P + h*w`` -> the same layout with q and k rotated, in qkv's dtype (the
    rotation is computed in float32 when qkv is lower precision).

    Raises:
        ValueError: an unknown ``kind`` or ``head_dim`` not a multiple of 4.
    """

    def __init__(self, kind: str, head_dim: int, num_prefix_tokens: int, temperature: float,
                 ref_grid: tuple[int, int] | None = None):
        super().__init__()
        if kind not in ROPE_KINDS:
            raise ValueError(f"rope must be one of {', '.join(ROPE_KINDS)}, got {kind!r}")
        if head_dim % 4:
            raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
        self.kind, self.head_dim, self.num_prefix_tokens = kind, head_dim, num_prefix_tokens
        self.temperature, self.ref_grid = float(temperature), None if ref_grid is None else tuple(ref_grid)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def angles(self, grid: tuple[int, int]) -> torch.Tensor:
        """Rotation angles ``(h*w, head_dim // 2)`` float32 of the patch tokens."""
        if self.kind == "eva":
            return eva_angles(grid, self.head_dim, self.ref_grid, self.temperature)
        return dinov3_angles(grid, self.head_dim, self.temperature)

    def tables(self, grid: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cos, sin, partner)``: float32 ``(P + h*w, head_dim)`` tables (prefix rows: cos 1,
        sin 0) with the rotation's sign folded into ``sin``, and the int64 ``(head_dim,)`` index of
        each channel's pair partner, so that ``rotate(x) = x * cos + x[..., partner] * sin``."""
        key = (tuple(grid), str(device))
        if key not in self._tables:
            ang = self.angles(tuple(grid))
            d = self.head_dim
            if self.kind == "eva":  # interleaved: (x0, x1) -> (-x1, x0)
                ang = ang.repeat_interleave(2, dim=-1)
                sign = torch.tensor([-1.0, 1.0]).repeat(d // 2)
                partner = torch.arange(d).view(-1, 2).flip(-1).flatten()
            else:  # rotate half: (x_i, x_{i+d/2}) -> (-x_{i+d/2}, x_i)
                ang = torch.cat([ang, ang], dim=-1)
                sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
                partner = torch.arange(d).roll(d // 2)
            p = self.num_prefix_tokens
            cos = torch.cat([torch.ones(p, d), ang.cos()])
            sin = torch.cat([torch.zeros(p, d), ang.sin() * sign])
            if len(self._tables) >= 8:  # a handful of input sizes in one process
                self._tables.clear()
            self._tables[key] = (cos.to(device), sin.to(device), partner.to(device))
        return self._tables[key]

    def forward(self, qkv: torch.Tensor, num_heads: int, grid: tuple[int, int]) -> torch.Tensor:
        b, n, c = qkv.shape
        cos, sin, partner = self.tables(grid, qkv.device)
        if cos.shape[0] != n:
            raise ValueError(f"RoPE for grid {tuple(grid)} covers {cos.shape[0]} tokens, the input has {n}")
        x = qkv.view(b, n, 3, num_heads, c // (3 * num_heads))
        qk = x[:, :, :2]
        cos, sin = cos.view(n, 1, 1, -1), sin.view(n, 1, 1, -1)
        rotated = (qk * cos + qk.index_select(-1, partner) * sin).to(qkv.dtype)
        return torch.cat([rotated, x[:, :, 2:]], dim=2).view(b, n, c)

    def extra_repr(self) -> str:
        ref = f", ref_grid={self.ref_grid}" if self.ref_grid else ""
        return f"kind={self.kind}, head_dim={self.head_dim}, temperature={self.temperature:g}{ref}"
