"""Swin's building blocks with timm's parameter names: window attention (V1 bias table, V2
continuous position bias and cosine attention), the (shifted-)window block and patch merging.

Swin Transformer (Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows"): attention inside non-overlapping ``M x M`` windows, every other block on
windows shifted by ``M // 2`` (a cyclic roll plus a mask, sec. 3.2), a learned relative position
bias per head. Swin V2 (Liu et al. 2022, "Swin Transformer V2: Scaling Up Capacity and
Resolution"): post-norm residuals, scaled cosine attention with a learned, clamped logit scale
and a log-spaced continuous position bias from a small MLP. The kernels are in
:mod:`vitflow.models.attention.window`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.attention.window import (
    WindowContext,
    log_spaced_coords,
    make_window_kernel,
    permute_tokens,
    prepare_qkv,
    relative_position_index,
    shift_mask,
    shifted_window_order,
    window_partition,
    window_probs,
    window_reverse,
)
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import DropPath, LayerNorm, Mlp, active
from vitflow.timing import tracing


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows: ``(B*nW, N, C)`` -> ``(B*nW, N, C)``.

    V1 (``version=1``): ``relative_position_bias_table`` ``((2wh-1)(2ww-1), H)``, ``qkv`` with
    bias. V2: ``logit_scale`` ``(H, 1, 1)``, ``cpb_mlp`` (2 -> 512 -> H, ReLU), ``qkv`` without
    bias plus ``q_bias`` / ``v_bias``; the bias is ``16 * sigmoid(cpb_mlp(coords))``.
    ``pretrained_window`` normalises V2's coordinates (timm's ``pretrained_window_size``).

    Raises:
        ValueError: ``dim`` not divisible by ``num_heads``, or an unknown backend.
    """

    def __init__(self, dim: int, num_heads: int, window: tuple[int, int], version: int = 1, qkv_bias: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, pretrained_window: tuple[int, int] = (0, 0),
                 backend: str = "sdpa"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"stage width {dim} is not divisible by its {num_heads} heads")
        self.num_heads, self.window, self.version = num_heads, tuple(window), version
        self.pretrained_window = tuple(pretrained_window)
        table = (2 * window[0] - 1) * (2 * window[1] - 1)
        if version == 1:
            self.relative_position_bias_table = nn.Parameter(torch.zeros(table, num_heads))
            self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        else:
            self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), torch.log(torch.tensor(10.0)).item()))
            self.cpb_mlp = nn.Sequential(Linear(2, 512), nn.ReLU(inplace=True), Linear(512, num_heads, bias=False))
            self.qkv = Linear(dim, dim * 3, bias=False)
            self.q_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
            self.v_bias = nn.Parameter(torch.zeros(dim)) if qkv_bias else None
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.register_buffer("relative_coords_table", log_spaced_coords(self.window, self.pretrained_window),
                                 persistent=False)
        self.register_buffer("relative_position_index", relative_position_index(self.window), persistent=False)
        self.attn_drop = attn_drop
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.set_backend(backend)

    def set_backend(self, backend: str, **_options) -> None:
        """Use window kernel ``backend`` (``sdpa``, ``math``, ``auto``); other backend options are
        ignored. Raises ValueError for another name."""
        self.kernel = make_window_kernel(backend)
        self.backend = backend

    def bias_parameters(self) -> list[nn.Parameter]:
        """The parameters the position bias is computed from."""
        if self.version == 1:
            return [self.relative_position_bias_table]
        return list(self.cpb_mlp.parameters())

    def position_bias(self) -> torch.Tensor:
        """The relative position bias ``(H, N, N)`` (V1: table lookup; V2: ``16 sigmoid(MLP)``)."""
        n = self.window[0] * self.window[1]
        if self.version == 1:
            table = self.relative_position_bias_table
        else:
            table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(n, n, self.num_heads).permute(2, 0, 1)
        # contiguous: the kernels add it to every window's logits (strided, that add ran ~6x slower)
        return (bias if self.version == 1 else 16 * torch.sigmoid(bias)).contiguous()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The packed qkv projection ``(B*nW, N, 3C)``."""
        if self.version == 1 or self.q_bias is None:
            return self.qkv(x)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        return F.linear(x, self.qkv.weight, bias)

    def context(self, bias: torch.Tensor, qkv_bias: torch.Tensor | None = None) -> WindowContext:
        return WindowContext(self.window, 0, bias, self.attn_drop if self.training else 0.0,
                             None if self.version == 1 else self.logit_scale, qkv_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Windows ``(B*nW, N, C)`` and the logit bias ``(nW or 1, H, N, N)`` -> ``(B*nW, N, C)``.
        V1's qkv bias gets its gradient from the kernel (:class:`~vitflow.models.attention.window.WindowContext`:
        the fused kernel sums it while writing qkv's gradient, one pass over that gradient less)."""
        b = self.qkv.bias
        if self.version == 1 and type(b) is nn.Parameter and b.requires_grad and torch.is_grad_enabled() \
                and not tracing() and type(self.qkv) is Linear and not self.qkv._forward_hooks:
            out = self.kernel(self.qkv(x, detach_bias=True), self.num_heads, self.context(bias, b))
        else:
            out = self.kernel(self.project(x), self.num_heads, self.context(bias))
        return self.proj_drop(self.proj(out))

    def probs(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention probabilities ``(B*nW, H, N, N)`` float32, computed explicitly."""
        q, k, _, scale = prepare_qkv(self.project(x).float(), self.num_heads, self.context(bias.float()))
        return window_probs(q, k, bias.float(), scale)


class SwinBlock(nn.Module):
    """A Swin block on ``(B, H, W, C)``: (shifted-)window attention then the MLP, each residual.

    V1 pre-norm: ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``; V2 post-norm:
    ``x + norm1(attn(x))``, ``x + norm2(mlp(x))``. ``resolution`` is the stage's feature grid at
    the model's image size: a window larger than it shrinks to it and then does not shift
    (timm's rule). Other grids are padded to whole windows; the mask of each padded grid is made
    once and, with the bias, kept while the bias parameters are unchanged and no gradient needs
    them (one ``(nW, H, N, N)`` tensor per block and shape).
    """

    grad_checkpointing = False  # recompute this block's activations in the backward pass

    def __init__(self, dim: int, num_heads: int, resolution: tuple[int, int], window: int, shifted: bool,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, version: int = 1, pretrained_window: int = 0, backend: str = "sdpa"):
        super().__init__()
        self.window = tuple(r if r <= window else window for r in resolution)
        self.shift = tuple(0 if r <= w or not shifted else window // 2 for r, w in zip(resolution, self.window))
        self.post_norm = version == 2
        self.norm1 = LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, self.window, version, qkv_bias, attn_drop, drop,
                                    (pretrained_window, pretrained_window), backend)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self._masks: dict[tuple, torch.Tensor | None] = {}
        self._orders: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bias: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def padded(self, h: int, w: int) -> tuple[int, int]:
        return -(-h // self.window[0]) * self.window[0], -(-w // self.window[1]) * self.window[1]

    def attn_bias(self, hp: int, wp: int, device: torch.device) -> torch.Tensor:
        """Position bias plus shift mask for a padded ``(hp, wp)`` grid: ``(nW, H, N, N)`` with a
        shift, ``(1, H, N, N)`` without; float32."""
        key = (hp, wp, device)
        if key not in self._masks:
            self._masks[key] = shift_mask((hp, wp), self.window, self.shift, device) if any(self.shift) else None
        mask = self._masks[key]
        params = self.attn.bias_parameters()
        if tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
            bias = self.attn.position_bias().unsqueeze(0)
            return bias if mask is None else bias + mask
        version = tuple((id(p), p._version) for p in params)
        cached = self._bias.get(key)
        if cached is None or cached[0] != version:
            bias = self.attn.position_bias().unsqueeze(0)
            cached = (version, bias if mask is None else bias + mask)
            self._bias[key] = cached
        return cached[1]

    def _shifted_windows(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """``(B, H, W, C)`` -> rolled, zero-padded windows ``(B*nW, N, C)`` and the padded grid."""
        h, w = x.shape[1], x.shape[2]
        if any(self.shift):
            x = torch.roll(x, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        hp, wp = self.padded(h, w)
        if (hp, wp) != (h, w):
            x = F.pad(x, (0, 0, 0, wp - w, 0, hp - h))
        return window_partition(x, self.window), hp, wp

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The window attention branch on ``(B, H, W, C)`` -> ``(B, H, W, C)``. A shifted grid of
        whole windows is rolled and partitioned in one gather (and back in one), others by
        roll, padding and reshapes."""
        b, h, w, c = x.shape
        if any(self.shift) and self.padded(h, w) == (h, w) and not tracing():
            key = (h, w, x.device)
            if key not in self._orders:
                self._orders[key] = shifted_window_order((h, w), self.window, self.shift, x.device)
            order, inverse = self._orders[key]
            windows = permute_tokens(x.reshape(b, h * w, c), order, inverse).view(-1, self.window[0] * self.window[1], c)
            out = self.attn(windows, self.attn_bias(h, w, x.device)).view(b, h * w, c)
            return permute_tokens(out, inverse, order).view(b, h, w, c)
        windows, hp, wp = self._shifted_windows(x)
        out = window_reverse(self.attn(windows, self.attn_bias(hp, wp, x.device)), self.window, hp, wp)
        if (hp, wp) != (h, w):
            out = out[:, :h, :w].contiguous()
        if any(self.shift):
            out = torch.roll(out, shifts=self.shift, dims=(1, 2))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, W, C)`` -> ``(B, H, W, C)``."""
        if self.post_norm:
            x = x + self.drop_path1(self.norm1(self.attend(x)))
            return x + self.drop_path2(self.norm2(self.mlp(x)))
        x = x + self.drop_path1(self.attend(self.norm1(x)))
        if not active(self.drop_path2) and type(self.mlp) is Mlp and type(self.mlp.fc2) is Linear \
                and not self.mlp.fc2._forward_hooks:
            return self.mlp(self.norm2(x), residual=x)  # the residual add inside fc2's GEMM
        return x + self.drop_path2(self.mlp(self.norm2(x)))

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """This block's attention on its input ``(B, H, W, C)`` placed back on the grid: float32
        ``(B, heads, H*W, H*W)``, row ``i`` the probabilities from token ``i`` (row-major, unshifted
        grid) to every token; zero outside the query's (shifted) window; padding tokens' share
        left out (rows then sum to <= 1)."""
        b, h, w, _ = x.shape
        xin = x if self.post_norm else self.norm1(x)
        windows, hp, wp = self._shifted_windows(xin)
        p = self.attn.probs(windows, self.attn_bias(hp, wp, x.device))  # (B*nW, H, N, N)
        heads, n = p.shape[1], p.shape[-1]
        # each window slot's grid index after rolling back, and whether it is a real token
        pos = torch.arange(h * w, device=x.device, dtype=torch.float32).view(1, h, w, 1)
        slots = self._shifted_windows(pos)[0].view(-1, n).long()  # (nW, N)
        valid = self._shifted_windows(torch.ones_like(pos))[0].view(-1, n) > 0
        pairs = valid[:, :, None] & valid[:, None, :]  # (nW, N, N)
        flat = (slots[:, :, None] * (h * w) + slots[:, None, :])[pairs]
        out = torch.zeros(b, heads, h * w * h * w, device=x.device)
        out[:, :, flat] = p.view(b, -1, heads, n, n).transpose(1, 2)[:, :, pairs]
        return out.view(b, heads, h * w, h * w)


class PatchMerging(nn.Module):
    """2x2 patch merging ``(B, H, W, C)`` -> ``(B, ceil(H/2), ceil(W/2), out_dim)``: the four
    neighbours concatenated (order (0,0), (1,0), (0,1), (1,1), the reference's), then V1
    ``reduction(norm(x))`` with ``norm`` over ``4C``, V2 ``norm(reduction(x))`` over ``out_dim``;
    ``reduction`` has no bias. An odd side is zero-padded."""

    def __init__(self, dim: int, out_dim: int | None = None, version: int = 1):
        super().__init__()
        self.out_dim = out_dim or 2 * dim
        self.post_norm = version == 2
        self.norm = LayerNorm(self.out_dim if self.post_norm else 4 * dim)
        self.reduction = Linear(4 * dim, self.out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        if h % 2 or w % 2:
            x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
            h, w = h + h % 2, w + w % 2
        x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.norm(self.reduction(x)) if self.post_norm else self.reduction(self.norm(x))
