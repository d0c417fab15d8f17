"""The pre-norm transformer encoder block and its multi-head self-attention (Vaswani et al.
2017; the ViT's block, Dosovitskiy et al. 2021, eq. 2-3). Parameter names follow timm's
(``norm1``, ``attn.qkv``, ``attn.proj``, ``ls1.gamma``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``,
``ls2.gamma``). The attention math itself lives in :mod:`vitflow.models.attention`."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from vitflow.models.attention import AttentionContext, attention_probs, make_kernel, split_heads
from vitflow.models.grad_checkpointing import CheckpointPlan
from vitflow.models.kernels import cpp
from vitflow.models.kernels import norm as norm_kernel
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import LN_EPS, DropPath, LayerScale, Mlp, SwiGLUPacked, active, make_mlp
from vitflow.models.position import RelativePositionBias


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection and a pluggable backend.

    Input and output ``(B, N, D)``. ``backend`` names a kernel of
    :mod:`vitflow.models.attention` (built by :func:`~vitflow.models.attention.make_kernel` with
    ``backend_options``); ``rel_pos`` adds a per-head relative position bias to the logits.
    ``head_dim`` defaults to ``dim // num_heads``; giving it explicitly allows
    ``num_heads * head_dim != dim`` (a head-pruned block, see :mod:`vitflow.infer.prune`): qkv is
    then ``D -> 3 * H * head_dim`` and proj ``H * head_dim -> D``.

    Raises:
        ValueError: ``dim`` not divisible by ``num_heads`` (without ``head_dim``), an unknown
            backend or one that cannot take the relative position bias.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, backend: str = "sdpa", grid: tuple[int, int] = (14, 14),
                 num_prefix_tokens: int = 1, rel_pos: bool = False, backend_options: dict | None = None,
                 head_dim: int | None = None):
        super().__init__()
        if head_dim is None and dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        inner = num_heads * self.head_dim
        self.grid, self.num_prefix_tokens = tuple(grid), num_prefix_tokens
        self.qkv = Linear(dim, inner * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = Linear(inner, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_pos = RelativePositionBias(num_heads, self.grid, num_prefix_tokens) if rel_pos else None
        self.set_backend(backend, **(backend_options or {}))

    def set_backend(self, backend: str, **options) -> None:
        """Replace the attention kernel (weights of qkv / proj unchanged; a Linformer's
        projections are new). Raises ValueError for an unknown backend or an unusable option."""
        kernel = make_kernel(backend, seq_len=self.num_prefix_tokens + self.grid[0] * self.grid[1],
                             head_dim=self.head_dim, **options)
        if self.rel_pos is not None and not kernel.supports_bias:
            raise ValueError(f"attention={backend} cannot use the relative position bias (pos_embed=relative)")
        self.backend, self.kernel = backend, kernel

    def context(self, grid: tuple[int, int] | None) -> AttentionContext:
        grid = self.grid if grid is None else tuple(grid)
        bias = self.rel_pos(grid) if self.rel_pos is not None else None
        return AttentionContext(grid, self.num_prefix_tokens, bias, self.attn_drop if self.training else 0.0)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N, D) -> (B, N, D)``; with ``residual`` (``(B, N, D)``) ``residual + attn(x)``, the
        add inside the output projection's GEMM while dropout is inactive."""
        h = self.kernel(self.qkv(x), self.num_heads, self.context(grid))
        if residual is not None and not active(self.proj_drop):
            return self.proj(h, residual=residual)
        out = self.proj_drop(self.proj(h))
        return out if residual is None else residual + out

    def probs(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Attention probabilities ``(B, H, N, N)`` float32 computed explicitly (the math path,
        with the relative bias and the sparse pattern if any) whatever the backend.

        For ``linformer`` and ``performer`` this is the exact softmax attention of the same
        queries and keys, which those backends approximate."""
        ctx = self.context(grid)
        q, k, _ = split_heads(self.qkv(x), self.num_heads)
        mask = self.kernel.mask(ctx.grid, ctx.num_prefix_tokens, x.device)
        bias = None if ctx.bias is None else ctx.bias.float()
        return attention_probs(q.float(), k.float(), bias, mask)


class Block(nn.Module):
    """Pre-norm transformer encoder block: ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``
    (each branch through stochastic depth). ``mlp_hidden`` overrides ``int(dim * mlp_ratio)`` and
    ``attn_kwargs`` may carry ``head_dim`` (pruned blocks, :mod:`vitflow.infer.prune`);
    ``act_layer`` is the MLP activation (:data:`~vitflow.models.layers.ACT_LAYERS`), ``norm_eps``
    the LayerNorm epsilon (1e-6 as in ViT; CLIP 1e-5), ``mlp_layer`` ``"mlp"`` or
    ``"swiglu_packed"`` (:func:`~vitflow.models.layers.make_mlp`).

    ``(B, N, D) -> (B, N, D)``. Where a branch adds its output unscaled (no LayerScale, stochastic
    depth and dropout inactive) the residual add runs inside the branch's last GEMM
    (:class:`~vitflow.models.kernels.matmul.Linear`): the same sum, two passes over ``x`` fewer.
    Under bf16 autocast on the CPU such a block instead adds the attention branch and normalises
    for the MLP in one pass (:func:`~vitflow.models.kernels.norm.add_layer_norm`, forward and
    backward), its first LayerNorm too, each straight to the bf16 the next GEMM reads.
    """

    grad_checkpointing = False  # recompute this block's activations in the backward pass

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, attention: str = "sdpa",
                 layer_scale_init: float | None = None, mlp_hidden: int | None = None, act_layer: str = "gelu",
                 norm_eps: float = LN_EPS, mlp_layer: str = "mlp", **attn_kwargs):
        super().__init__()
        cpp.available()  # the fused add + LayerNorm of bf16 autocast (norm_kernel): built here, never in a forward
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, attention, **attn_kwargs)
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = make_mlp(mlp_layer, dim, mlp_hidden or int(dim * mlp_ratio), drop, act_layer)
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        plain = self.residual_in_gemm()
        if plain and norm_kernel.fusable(x, self.norm1, self.norm2):  # bf16 CPU autocast
            _, h = norm_kernel.add_layer_norm(x, None, self.norm1)
            x, h = norm_kernel.add_layer_norm(x, self.attn(h, grid), self.norm2)
            return x + self.mlp(h)
        if plain:
            x = self.attn(self.norm1(x), grid, residual=x)
            return self.mlp(self.norm2(x), residual=x)
        if self.residual_in_layer_scale():
            x = self.ls1(self.attn(self.norm1(x), grid), residual=x)
            return self.ls2(self.mlp(self.norm2(x)), residual=x)
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), grid)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def residual_in_layer_scale(self) -> bool:
        """Both branches end in a :class:`~vitflow.models.layers.LayerScale` (DeiT III, DINOv2) and
        stochastic depth is inactive: ``x + gamma * branch`` runs as one ``addcmul`` pass."""
        return (type(self.ls1) is LayerScale and type(self.ls2) is LayerScale
                and not (active(self.drop_path1) or active(self.drop_path2)))

    def residual_in_gemm(self) -> bool:
        """Both branches are vitflow's own modules (export and quantization swap in others), end in
        a :class:`~vitflow.models.kernels.matmul.Linear` whose output no forward hook inspects, and add
        their output unscaled: no LayerScale, stochastic depth inactive."""
        return (isinstance(self.attn, Attention) and isinstance(self.mlp, (Mlp, SwiGLUPacked))
                and type(self.ls1) is nn.Identity and type(self.ls2) is nn.Identity
                and not (active(self.drop_path1) or active(self.drop_path2))
                and all(type(m) is Linear and not m._forward_hooks for m in (self.attn.proj, self.mlp.fc2)))


class Blocks(nn.Sequential):
    """The encoder's blocks in order (state-dict names ``blocks.{i}``, as timm's).

    ``forward(x, grid)``: tokens ``(B, N, D)`` through every block; a block whose
    ``grad_checkpointing`` is set keeps only its input and recomputes the rest in the backward
    pass (``torch.utils.checkpoint``, non-reentrant; Chen et al. 2016) while gradients are on.
    ``checkpoint_plan`` says which blocks (:class:`~vitflow.models.grad_checkpointing.CheckpointPlan`;
    an ``auto`` plan is resolved per input shape by :mod:`vitflow.models.autotune`). Under bf16 CPU
    autocast, blocks that fuse their norms (:meth:`Block.forward`), none checkpointed or hooked, also
    fuse each block's last residual add into the next block's first LayerNorm.
    """

    def __init__(self, *blocks: Block):  # (also an OrderedDict, as nn.Sequential's slicing passes)
        super().__init__(*blocks)
        self.checkpoint_plan = CheckpointPlan()
        self.tuned_inputs: set[tuple] = set()  # input kinds whose auto choices are made (models.autotune)

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        recompute = torch.is_grad_enabled()
        if self._chain_fusable(x, recompute):
            return self._fused_chain(x, grid)
        for blk in self:
            x = checkpoint(blk, x, grid, use_reentrant=False) if recompute and blk.grad_checkpointing else blk(x, grid)
        return x

    def _chain_fusable(self, x: torch.Tensor, recompute: bool) -> bool:
        """Whether every block is a plain :class:`Block` that fuses its norms (:meth:`Block.forward`),
        none checkpointed (while gradients are on) and none hooked: each block's last add then runs
        in the next block's first norm (:meth:`_fused_chain`)."""
        blocks = list(self)  # the input's checks (dtype, autocast) first: outside bf16 CPU autocast they end it
        return (len(blocks) > 1 and norm_kernel.fusable(x, *(n for b in blocks for n in (b.norm1, b.norm2)))
                and all(type(b) is Block and b.residual_in_gemm() for b in blocks)
                and not any(b._forward_hooks or b._forward_pre_hooks or (recompute and b.grad_checkpointing)
                            for b in blocks))

    def _fused_chain(self, x: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
        """The blocks' forwards with each residual add in the LayerNorm that follows it
        (:func:`~vitflow.models.kernels.norm.add_layer_norm`): the same sums, one pass per add fewer."""
        blocks = list(self)
        x, h = norm_kernel.add_layer_norm(x, None, blocks[0].norm1)
        for blk, following in zip(blocks, blocks[1:]):
            x, h = norm_kernel.add_layer_norm(x, blk.attn(h, grid), blk.norm2)
            x, h = norm_kernel.add_layer_norm(x, blk.mlp(h), following.norm1)
        x, h = norm_kernel.add_layer_norm(x, blocks[-1].attn(h, grid), blocks[-1].norm2)
        return x + blocks[-1].mlp(h)

    def attention_maps(self, x: torch.Tensor, grid: tuple[int, int],
                       layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Attention probabilities of the blocks ``layers`` (indices, negative from the end;
        ``None`` = all) for tokens ``x`` ``(B, N, D)`` entering the first block: one float32
        ``(B, H, N, N)`` per requested block, in the order given, from each block's
        ``attn.probs(norm1(x), grid)`` (explicit, whatever the backend). Runs the blocks up to the
        deepest requested one, under the caller's grad mode.

        Raises:
            IndexError: a layer index out of range.
        """
        wanted = wanted_layers(layers, len(self))
        maps: dict[int, torch.Tensor] = {}
        for i, blk in enumerate(self):
            if i > max(wanted):
                break
            if i in wanted:
                maps[i] = blk.attn.probs(blk.norm1(x), grid)
            x = blk(x, grid)
        return [maps[i] for i in wanted]

    def set_plan(self, plan: CheckpointPlan) -> None:
        """Checkpoint the blocks ``plan`` names (an ``auto`` plan is resolved per input shape by
        :mod:`vitflow.models.autotune`) and keep the plan as :attr:`checkpoint_plan`."""
        self.set_checkpointed(plan.blocks(len(self)) if plan.mode != "auto" else frozenset())
        self.checkpoint_plan = plan

    def set_checkpointed(self, indices: frozenset[int]) -> None:
        """Checkpoint exactly the blocks ``indices``."""
        for i, blk in enumerate(self):
            blk.grad_checkpointing = i in indices


def wanted_layers(layers: int | Sequence[int] | None, depth: int) -> list[int]:
    """Block indices ``layers`` (one, several, negative from the end, ``None`` = all) of a
    ``depth``-block model as non-negative indices. Raises IndexError for one out of range."""
    wanted = list(range(depth)) if layers is None else [layers] if isinstance(layers, int) else list(layers)
    for i in wanted:
        if not -depth <= i < depth:
            raise IndexError(f"layer {i} out of range for a {depth}-block model")
    return [i % depth for i in wanted]
