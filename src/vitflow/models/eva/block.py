"""The pre-norm block of BEiT, EVA-02 and DINOv3 and its attention, with timm's parameter names.

Attention (``blocks.{i}.attn``): a fused ``qkv`` linear without bias plus ``q_bias`` and ``v_bias``
(no key bias: BEiT, Bao et al. 2022; a key bias would cancel in the softmax), or separate
``q_proj`` / ``k_proj`` / ``v_proj`` (EVA-02 base and large); BEiT's per-block
``relative_position_bias_table`` (with the class-token entries, :mod:`vitflow.models.position`);
2-D RoPE on q and k (:mod:`vitflow.models.rope`, shared with the model); an optional LayerNorm
``norm`` on the attention output before ``proj`` (EVA-02 CLIP's inner norm). The attention math
runs in vitflow's exact backends (:mod:`vitflow.models.attention`: ``sdpa``, ``math``,
``blockwise``, ``auto``) on the packed, rotated qkv.

Block (``blocks.{i}``): ``x + drop_path(gamma_1 * attn(norm1(x)))`` then
``x + drop_path(gamma_2 * mlp(norm2(x)))``; ``gamma_1`` / ``gamma_2`` are LayerScale (CaiT,
Touvron et al. 2021) under timm's BEiT/EVA names, absent without LayerScale.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.attention import EXACT_BACKENDS, AttentionContext, attention_probs, make_kernel, split_heads
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import DropPath
from vitflow.models.position import relative_position_index, resample_relative_table
from vitflow.models.rope import Rope2d

BACKENDS = (*EXACT_BACKENDS, "auto")  # the kernels that take a rotated / biased qkv over all tokens


class EvaAttention(nn.Module):
    """Multi-head self-attention with q/v bias, optional relative position bias, RoPE and inner norm.

    Args:
        dim: token width ``D`` (``num_heads`` heads of ``D / num_heads``).
        qkv_bias: learned ``q_bias`` and ``v_bias`` (the key bias is a zero buffer).
        fused: one ``qkv`` linear (else ``q_proj``, ``k_proj`` without bias, ``v_proj``:
            :class:`EvaSplitAttention`).
        grid: the native patch grid (relative position table size).
        num_prefix_tokens: tokens before the grid (class, registers).
        rel_pos: BEiT's relative position bias (needs exactly one prefix token).
        rope: the model's :class:`~vitflow.models.rope.Rope2d` or ``None``; held by reference,
            not as a submodule (it has no parameters; the model owns it as ``rope``).
        inner_norm_eps: a LayerNorm ``norm`` on the attention output (EVA-02 CLIP), or ``None``.
        backend: one of :data:`BACKENDS`; ``backend_options`` go to
            :func:`~vitflow.models.attention.make_kernel`.

    ``forward(x, grid)``: ``(B, N, D) -> (B, N, D)`` with ``N = P + h*w`` for ``grid = (h, w)``.

    Raises:
        ValueError: ``dim`` not divisible by ``num_heads``, a backend outside :data:`BACKENDS`.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, fused: bool = True,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, grid: tuple[int, int] = (14, 14),
                 num_prefix_tokens: int = 1, rel_pos: bool = False, rope: Rope2d | None = None,
                 inner_norm_eps: float | None = None, backend: str = "sdpa", backend_options: dict | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.grid, self.num_prefix_tokens = tuple(grid), num_prefix_tokens
        self.attn_drop = attn_drop
        if fused:
            self.qkv = Linear(dim, 3 * dim, bias=False)
        if fused and qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.v_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        if rel_pos:
            size = (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1) + 3
            self.relative_position_bias_table = nn.Parameter(torch.zeros(size, num_heads))
            self.register_buffer("relative_position_index", relative_position_index(self.grid, 1), persistent=False)
        else:
            self.relative_position_bias_table = None
        self.__dict__["rope"] = rope  # a reference, not a submodule
        self.norm = nn.LayerNorm(dim, eps=inner_norm_eps) if inner_norm_eps is not None else nn.Identity()
        self.proj = Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.set_backend(backend, **(backend_options or {}))

    def set_backend(self, backend: str, **options) -> None:
        """Replace the attention kernel (weights unchanged).

        Raises:
            ValueError: a backend outside :data:`BACKENDS` (sparse and linear kernels assume the
                plain ViT's unrotated, unbiased qkv), or a bad option.
        """
        if backend not in BACKENDS:
            raise ValueError(f"attention={backend} is not available for this model (RoPE / relative position bias / "
                             f"q-v bias attention); use one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.kernel = make_kernel(backend, seq_len=self.num_prefix_tokens + self.grid[0] * self.grid[1],
                                  head_dim=self.head_dim, **options)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """The projection ``(B, N, D) -> (B, N, 3D)`` (q, k, v heads-major) with its biases: one GEMM
        with the bias, as timm's, unless ``qkv`` was replaced or wrapped (LoRA, quantization), is
        hooked, or runs under CPU autocast (where :class:`~vitflow.models.kernels.matmul.Linear` picks its
        GEMM): then ``qkv(x) + bias``."""
        if self.q_bias is None:
            return self.qkv(x)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        plain = type(self.qkv) is Linear and not self.qkv._forward_hooks and not self.qkv._forward_pre_hooks
        if plain and not (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")):
            return F.linear(x, self.qkv.weight, bias)
        return self.qkv(x) + bias

    def rel_bias(self, grid: tuple[int, int]) -> torch.Tensor | None:
        """The relative position bias ``(H, N, N)`` for ``grid`` (the table resampled bicubically
        for another grid than the native one), or ``None``."""
        table = self.relative_position_bias_table
        if table is None:
            return None
        if grid == self.grid:
            index = self.relative_position_index
        else:
            table = resample_relative_table(table, self.grid, grid, 1)
            index = relative_position_index(grid, 1).to(table.device)
        n = index.shape[0]
        return table[index.reshape(-1)].reshape(n, n, self.num_heads).permute(2, 0, 1)

    def context(self, grid: tuple[int, int] | None) -> AttentionContext:
        grid = self.grid if grid is None else tuple(grid)
        return AttentionContext(grid, self.num_prefix_tokens, self.rel_bias(grid),
                                self.attn_drop if self.training else 0.0)

    def rotated(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        qkv = self.packed(x)
        return qkv if self.rope is None else self.rope(qkv, self.num_heads, grid)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        ctx = self.context(grid)
        h = self.kernel(self.rotated(x, ctx.grid), self.num_heads, ctx)
        return self.proj_drop(self.proj(self.norm(h)))

    def probs(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Attention probabilities ``(B, H, N, N)`` float32, computed explicitly (rotated q, k and
        the relative bias included) whatever the backend."""
        ctx = self.context(grid)
        q, k, _ = split_heads(self.rotated(x, ctx.grid), self.num_heads)
        return attention_probs(q.float(), k.float(), None if ctx.bias is None else ctx.bias.float())


class EvaSplitAttention(EvaAttention):
    """:class:`EvaAttention` with separate ``q_proj`` (bias), ``k_proj`` (no bias) and ``v_proj``
    (bias) linears, timm's ``qkv_fused=False`` (EVA-02 base / large). ``qkv(x)`` returns their
    packed ``(B, N, 3D)`` output, as the fused layer's would be."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, **kwargs):
        super().__init__(dim, num_heads, qkv_bias, fused=False, **kwargs)
        self.q_proj = Linear(dim, dim, bias=qkv_bias)
        self.k_proj = Linear(dim, dim, bias=False)
        self.v_proj = Linear(dim, dim, bias=qkv_bias)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


class EvaBlock(nn.Module):
    """Pre-norm block with LayerScale ``gamma_1`` / ``gamma_2`` (see the module docstring).

    ``(B, N, D) -> (B, N, D)``; ``grid`` is the patch grid of this input.
    """

    grad_checkpointing = False  # recompute this block's activations in the backward pass (Blocks)

    def __init__(self, dim: int, attn: EvaAttention, mlp: nn.Module, norm_eps: float = 1e-6,
                 init_values: float | None = None, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = attn
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(init_values))) if init_values is not None else None
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = mlp
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(init_values))) if init_values is not None else None
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        y = self.attn(self.norm1(x), grid)
        x = x + self.drop_path1(y if self.gamma_1 is None else self.gamma_1 * y)
        y = self.mlp(self.norm2(x))
        return x + self.drop_path2(y if self.gamma_2 is None else self.gamma_2 * y)
