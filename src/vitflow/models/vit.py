"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}.norm1``, ``.attn.qkv``, ``.attn.proj``, ``.norm2``, ``.mlp.fc1``,
``.mlp.fc2``, ``norm`` / ``fc_norm``, ``head``) so that a timm state_dict of the same
configuration loads with ``strict=True``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vitflow.models.attention import get_backend

LN_EPS = 1e-6  # the ViT / timm LayerNorm epsilon


class PatchEmbed(nn.Module):
    """Non-overlapping patch embedding by a strided convolution.

    Input ``(B, C, H, W)`` float -> output ``(B, N, D)`` with ``N = (H / p) * (W / p)``.

    Raises:
        ValueError: H or W is not a multiple of the patch size.
    """

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"input size {h}x{w} is not a multiple of patch size {self.patch_size}")
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection.

    Input and output ``(B, N, D)``. ``backend`` names a function in
    :mod:`vitflow.models.attention`.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, backend: str = "sdpa"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.set_backend(backend)

    def set_backend(self, backend: str) -> None:
        self.backend = backend
        self._attend = get_backend(backend)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``(B, N, D)`` into q, k, v of shape ``(B, H, N, head_dim)`` each."""
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv_heads(x)
        x = self._attend(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, d)))


class Mlp(nn.Module):
    """Two-layer GELU MLP: ``fc1 -> GELU -> dropout -> fc2 -> dropout``; ``(B, N, D) -> (B, N, D)``."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth per sample (Huang et al. 2016): drops the residual branch of a whole
    sample with probability ``p`` in training and rescales survivors by ``1 / (1 - p)``."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class PatchDropout(nn.Module):
    """PatchDropout (Liu et al. 2022; timm's ``patch_drop_rate``): in training, each sample keeps
    a random ``1 - p`` of its patch tokens (the prefix tokens always), so every block costs about
    ``1 - p`` as much; the identity in eval mode. ``(B, P + N, D) -> (B, P + K, D)``,
    ``K = max(1, int(N * (1 - p)))``; uses the global torch RNG."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        prefix, patches = x[:, :num_prefix_tokens], x[:, num_prefix_tokens:]
        b, n, d = patches.shape
        keep = torch.rand(b, n, device=x.device).argsort(dim=1)[:, :max(1, int(n * (1 - self.p)))]
        return torch.cat([prefix, patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, d))], dim=1)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Pre-norm transformer encoder block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, attention: str = "sdpa"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, attention)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """ViT image classifier.

    Args:
        img_size: training resolution in pixels (square); fixes the position-embedding grid.
        patch_size: patch side in pixels.
        in_chans: input channels.
        num_classes: classifier outputs; 0 gives ``head = Identity`` (features only).
        embed_dim, depth, num_heads, mlp_ratio: width, blocks, heads, MLP hidden / width.
        qkv_bias: bias on the qkv projection.
        global_pool: ``"token"`` (class token, as in ViT) or ``"avg"`` (mean of patch tokens;
            no class token, ``fc_norm`` instead of ``norm`` as in timm / MAE).
        drop_rate, attn_drop_rate: dropout on activations and on attention probabilities.
        drop_path_rate: stochastic-depth rate of the last block, rising linearly from 0.
        attention: attention backend name (see :mod:`vitflow.models.attention`).
        patch_drop_rate: fraction of patch tokens dropped per sample in training (:class:`PatchDropout`).

    ``forward(x)``: ``(B, in_chans, H, W)`` float -> logits ``(B, num_classes)``.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, global_pool: Literal["token", "avg"] = "token", drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, attention: str = "sdpa",
                 patch_drop_rate: float = 0.0):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.num_classes, self.embed_dim, self.global_pool = num_classes, embed_dim, global_pool
        self.grid_size = img_size // patch_size
        self.num_prefix_tokens = 1 if global_pool == "token" else 0
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if self.num_prefix_tokens else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size**2 + self.num_prefix_tokens, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.patch_drop = PatchDropout(patch_drop_rate)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, dpr[i], attention)
            for i in range(depth)
        ])
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(embed_dim, eps=LN_EPS)
        self.fc_norm = nn.LayerNorm(embed_dim, eps=LN_EPS) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's default init: truncated normal (std 0.02) for linears and the position
        embedding, 1e-6 normal for the class token, zero biases, unit LayerNorms."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names excluded from weight decay beside all 1-D parameters (norms, biases)."""
        return {"pos_embed", "cls_token"}

    def set_attention_backend(self, backend: str) -> None:
        """Switch every block's attention backend (weights unchanged)."""
        for blk in self.blocks:
            blk.attn.set_backend(backend)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass (torch.utils.checkpoint,
        non-reentrant) to trade compute for activation memory."""
        self.grad_checkpointing = enable

    def _pos_embed(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        pos = self.pos_embed
        if grid_hw != (self.grid_size, self.grid_size):
            pos = resample_pos_embed(pos, grid_hw, self.num_prefix_tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + pos)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens ``(B, N, D)`` after the final norm (class token first when
        ``global_pool == "token"``)."""
        grid_hw = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        x = self.patch_drop(self._pos_embed(self.patch_embed(x), grid_hw), self.num_prefix_tokens)
        if self.grad_checkpointing and torch.is_grad_enabled():
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens ``(B, N, D)`` -> logits ``(B, num_classes)`` (or pooled ``(B, D)`` if ``pre_logits``)."""
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised ``Linear(embed_dim, num_classes)``."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1,
                       mode: str = "bicubic") -> torch.Tensor:
    """Resample a learned position embedding to a new patch grid (ViT paper, sec. 3.2).

    Args:
        pos_embed: ``(1, P + g*g, D)`` with ``P`` prefix (class) tokens first and a square grid.
        new_grid: target ``(h, w)`` in patches.
    Returns:
        ``(1, P + h*w, D)`` in the input dtype; prefix tokens are kept as they are.
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
