"""Pooling the encoder's tokens into one feature vector per image: the class token, the mean of
the patch tokens, or multihead attention pooling (MAP).

MAP (Lee et al. 2019, "Set Transformer", PMA; Zhai et al. 2022, "Scaling Vision Transformers",
the head of big_vision's ViT and of SigLIP, Zhai et al. 2023): one learned latent query attends to
the patch tokens, followed by a pre-norm residual MLP. Parameter names follow timm's
``AttentionPoolLatent`` (``attn_pool.latent``, ``.q``, ``.kv``, ``.proj``, ``.norm``,
``.mlp.fc1``, ``.mlp.fc2``) so SigLIP checkpoints in timm's layout load as they are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitflow.models.attention.core import attention_probs, sdpa_attention
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import LN_EPS, Mlp

POOLS = ("token", "avg", "map")


class AttentionPoolLatent(nn.Module):
    """Attention pooling with a learned latent query (one latent, as timm's default and SigLIP).

    ``forward(x)``: patch tokens ``(B, N, D)`` float -> pooled ``(B, D)``:
    ``y = proj(softmax(q k^T / sqrt(d)) v)`` with ``q = q(latent)``, ``k, v = kv(x)`` split in
    ``num_heads`` heads, then ``y + mlp(norm(y))``.

    Args:
        dim: token width (and output width).
        num_heads: attention heads (``dim`` divisible by it).
        mlp_ratio: MLP hidden width / ``dim``.
        norm_eps: LayerNorm epsilon.
        act_layer: MLP activation (:data:`vitflow.models.layers.ACT_LAYERS`).
    Raises:
        ValueError: ``dim`` not divisible by ``num_heads``, an unknown activation.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, norm_eps: float = LN_EPS,
                 act_layer: str = "gelu", qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"attention pooling: embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = Linear(dim, dim, bias=qkv_bias)
        self.kv = Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer)
        self.init_weights()

    def init_weights(self) -> None:
        """The latent from a truncated normal with std ``dim ** -0.5`` (timm's); the linears and
        the norm are initialised by the model's :meth:`~vitflow.models.vit.model.VisionTransformer.init_weights`."""
        nn.init.trunc_normal_(self.latent, std=self.latent.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h, hd = self.num_heads, self.head_dim
        q = self.q(self.latent).reshape(1, 1, h, hd).transpose(1, 2).expand(b, -1, -1, -1)
        k, v = self.kv(x).reshape(b, n, 2, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
        y = sdpa_attention(q, k, v).transpose(1, 2).reshape(b, 1, d)
        y = self.proj(y)
        y = y + self.mlp(self.norm(y))
        return y[:, 0]

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """The latent query's attention probabilities over the tokens ``(B, num_heads, N)`` float32
        (what the pooled feature is a weighted sum of, per head)."""
        b, n, _ = x.shape
        h, hd = self.num_heads, self.head_dim
        q = self.q(self.latent).reshape(1, h, 1, hd).float()
        k = self.kv(x)[..., :h * hd].reshape(b, n, h, hd).transpose(1, 2).float()
        return attention_probs(q, k)[:, :, 0]


def pool_tokens(x: torch.Tensor, global_pool: str, num_prefix_tokens: int,
                attn_pool: AttentionPoolLatent | None = None, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens ``(B, N, D)`` -> ``(B, D)``: ``token`` (token 0, the class token), ``avg`` (mean of
    the patch tokens, the prefix tokens left out as in timm) or ``map`` (``attn_pool`` over the
    patch tokens). ``sizes`` ``(B, N, 1)``: the patches each token stands for after token merging
    (:mod:`vitflow.models.token_merging`); ``avg`` then weighs each token by its size."""
    if global_pool == "token":
        return x[:, 0]
    patches = x[:, num_prefix_tokens:]
    if global_pool == "avg" and sizes is not None:
        w = sizes[:, num_prefix_tokens:].to(x.dtype)
        return (patches * w).sum(dim=1) / w.sum(dim=1)
    return patches.mean(dim=1) if global_pool == "avg" else attn_pool(patches)
