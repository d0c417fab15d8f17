"""Position encodings for the patch grid: learned (resampled), fixed 2-D sine-cosine, and
per-head relative position bias.

- ``learned``: a trained ``(1, P + h*w, D)`` table added to the tokens (ViT, Dosovitskiy et al.
  2021). :func:`resample_pos_embed` resizes its grid part bicubically when the image or patch
  size changes (ViT sec. 3.2), both when loading weights and at run time for another input size.
- ``sincos2d``: fixed ``[sin(x w), cos(x w), sin(y w), cos(y w)]`` features of the patch row and
  column (MoCo v3, Chen et al. 2021; big_vision ``posemb_sincos_2d``); computed for any grid,
  so another input size needs no resampling.
- ``relative``: a learned bias per head and 2-D offset ``(dy, dx)`` added to the attention
  logits (Swin, Liu et al. 2021; BEiT, Bao et al. 2022, with its three extra entries for the
  class token). No absolute embedding is added to the tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

POS_EMBEDS = ("learned", "sincos2d", "relative")


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1,
                       mode: str = "bicubic") -> torch.Tensor:
    """Resample a learned position embedding to a new patch grid (ViT paper, sec. 3.2).

    Args:
        pos_embed: ``(1, P + g*g, D)`` with ``P`` prefix (class) tokens first and a square grid.
        new_grid: target ``(h, w)`` in patches.
        mode: ``F.interpolate`` mode (antialiased when downsampling).
    Returns:
        ``(1, P + h*w, D)`` in the input dtype; prefix tokens are kept as they are. The input
        itself when the grid already matches.
    Raises:
        ValueError: the grid part is not square.
    """
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old = math.isqrt(grid.shape[1])
    if old * old != grid.shape[1]:
        raise ValueError(f"position embedding grid of {grid.shape[1]} tokens is not square")
    if (old, old) == tuple(new_grid):
        return pos_embed
    dim = grid.shape[-1]
    grid = grid.reshape(1, old, old, dim).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=tuple(new_grid), mode=mode, align_corners=False, antialias=mode != "nearest")
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, dim).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def sincos_2d(grid: tuple[int, int], dim: int, num_prefix_tokens: int = 1, temperature: float = 10000.0,
              dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding, as big_vision's ``posemb_sincos_2d``.

    Quarter ``j`` of the ``dim`` channels holds ``sin(x w)``, ``cos(x w)``, ``sin(y w)``,
    ``cos(y w)`` for column ``x`` and row ``y`` with ``w_i = temperature ** -(i / (dim/4 - 1))``.

    Returns:
        ``(1, P + h*w, dim)`` in ``dtype``; the ``P`` prefix (class) tokens get zeros.
    Raises:
        ValueError: ``dim`` is not a multiple of 4.
    """
    if dim % 4:
        raise ValueError(f"sincos2d position embedding needs embed_dim divisible by 4, got {dim}")
    h, w = grid
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / max(quarter - 1, 1))
    xw, yw = x.reshape(-1, 1) * omega, y.reshape(-1, 1) * omega
    pe = torch.cat([xw.sin(), xw.cos(), yw.sin(), yw.cos()], dim=1)
    pe = torch.cat([pe.new_zeros(num_prefix_tokens, dim), pe])[None]
    return pe.to(dtype=dtype, device=device)


def relative_position_index(grid: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Index into a relative-position table for every (query, key) token pair.

    Patch pairs map to their offset ``(dy + h - 1) * (2w - 1) + (dx + w - 1)``; with a class
    token the three entries after the ``(2h-1)(2w-1)`` offsets are class->patch, patch->class and
    class->class, as in BEiT (Bao et al. 2022).

    Returns:
        ``int64 (P + h*w, P + h*w)``.
    """
    h, w = grid
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[:, None] - ys[None, :] + h - 1
    dx = xs[:, None] - xs[None, :] + w - 1
    idx = dy * (2 * w - 1) + dx
    if not num_prefix_tokens:
        return idx
    n = (2 * h - 1) * (2 * w - 1)
    full = torch.empty(h * w + 1, h * w + 1, dtype=torch.long)
    full[1:, 1:] = idx
    full[0, 1:], full[1:, 0], full[0, 0] = n, n + 1, n + 2
    return full


class RelativePositionBias(nn.Module):
    """Per-head learned relative position bias over the 2-D patch grid (Swin / BEiT).

    ``relative_position_bias_table``: ``((2h-1)(2w-1) + 3*[class token], num_heads)``, initialised
    from a truncated normal with std 0.02 as in Swin. ``forward(grid)`` returns the bias ``(num_heads, N, N)`` to add to the
    attention logits; for another grid the offset table is resized bicubically first (as BEiT
    does when fine-tuning at a higher resolution).
    """

    def __init__(self, num_heads: int, grid: tuple[int, int], num_prefix_tokens: int = 1):
        super().__init__()
        if num_prefix_tokens > 1:
            raise ValueError("relative position bias supports at most one prefix (class) token")
        self.num_heads, self.grid, self.num_prefix_tokens = num_heads, tuple(grid), num_prefix_tokens
        size = (2 * grid[0] - 1) * (2 * grid[1] - 1) + (3 if num_prefix_tokens else 0)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(size, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(self.grid, num_prefix_tokens),
                             persistent=False)

    def table_for(self, grid: tuple[int, int]) -> torch.Tensor:
        """The bias table resized to ``grid`` (the stored one when ``grid`` is the native one)."""
        return resample_relative_table(self.relative_position_bias_table, self.grid, grid, self.num_prefix_tokens)

    def forward(self, grid: tuple[int, int] | None = None) -> torch.Tensor:
        grid = self.grid if grid is None else tuple(grid)
        if grid == self.grid:
            table, index = self.relative_position_bias_table, self.relative_position_index
        else:
            table = self.table_for(grid)
            index = relative_position_index(grid, self.num_prefix_tokens).to(table.device)
        n = index.shape[0]
        return table[index.reshape(-1)].reshape(n, n, self.num_heads).permute(2, 0, 1)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, grid={self.grid}"


def resample_relative_table(table: torch.Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int],
                            num_prefix_tokens: int = 1) -> torch.Tensor:
    """Resize a relative-position bias table ``((2h-1)(2w-1) [+3], H)`` from ``old_grid`` to
    ``new_grid`` by bicubic interpolation of its offset plane; the class-token entries are kept."""
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return table
    n_old = (2 * old_grid[0] - 1) * (2 * old_grid[1] - 1)
    if table.shape[0] != n_old + (3 if num_prefix_tokens else 0):
        raise ValueError(f"relative position table of {table.shape[0]} rows does not fit grid {old_grid}")
    plane, extra = table[:n_old], table[n_old:]
    heads = table.shape[1]
    plane = plane.T.reshape(1, heads, 2 * old_grid[0] - 1, 2 * old_grid[1] - 1).float()
    plane = F.interpolate(plane, size=(2 * new_grid[0] - 1, 2 * new_grid[1] - 1), mode="bicubic",
                          align_corners=False)
    plane = plane.reshape(heads, -1).T.to(table.dtype)
    return torch.cat([plane, extra])
