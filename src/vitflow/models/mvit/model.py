"""MViTv2 (Li et al. 2022, "MViTv2: Improved Multiscale Vision Transformers for Classification and
Detection") with timm's parameter names.

Layout (timm's ``MultiScaleVit``): ``patch_embed.proj`` (an overlapping convolution: kernel
``2p - 1``, stride ``p``, padding ``p - 1``; 7 / 4 / 3 for ImageNet) -> optional ``cls_token`` ->
``stages.{i}.blocks.{j}`` (:class:`~vitflow.models.mvit.block.MultiScaleBlock`; the first block
of stage ``i > 0`` pools the query grid by 2 and widens the tokens) -> ``norm`` -> ``head``
(``drop``, ``fc``; average of the grid tokens, or the class token). Tokens are ``(B, N, C)``,
class token first, grid row-major; ``forward_features`` returns them after the final norm, as
timm's. A timm state_dict of the same name loads with ``strict=True``.

Other input sizes run as they are: each block's grid follows from its input (pooled sides are
``ceil(side / stride)``) and the relative position tables are resampled to the grids met
(:meth:`~vitflow.models.mvit.pooling.MultiScaleAttention.context`, logged once per grid).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from vitflow.models.block import wanted_layers
from vitflow.models.encoder import StageControls
from vitflow.models.grad_checkpointing import CheckpointPlan
from vitflow.models.layers import LN_EPS, LayerNorm, classifier_head
from vitflow.models.mvit.block import MultiScaleBlock
from vitflow.models.mvit.plan import plan_mvit_checkpointing, stage_layout
from vitflow.models.mvit.pooling import pooled_size


class MViTStage(nn.Module):
    """``blocks`` run in turn on ``(x, grid)``; checkpointed blocks recompute in the backward."""

    def __init__(self, blocks: Sequence[MultiScaleBlock]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
        recompute = torch.is_grad_enabled()
        for blk in self.blocks:
            x, grid = checkpoint(blk, x, grid, use_reentrant=False) if recompute and blk.grad_checkpointing \
                else blk(x, grid)
        return x, grid


class MViTHead(nn.Module):
    """timm's head: ``drop`` then ``fc`` (``nn.Identity`` for 0 classes)."""

    def __init__(self, num_features: int, num_classes: int, drop: float = 0.0, gemm: str = "auto"):
        super().__init__()
        self.drop = nn.Dropout(drop)
        self.fc = classifier_head(num_features, num_classes, gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x))


class MultiScaleVit(StageControls, nn.Module):
    """MViTv2 image classifier.

    Args:
        img_size: input side in pixels the relative tables are sized for (other sizes resample).
        patch_size: the patch embedding's stride (kernel ``patch_kernel``, default
            ``2 patch_size - 1``; padding ``kernel // 2``).
        in_chans, num_classes (0: no head), drop_rate, drop_path_rate (per stage, rising
            linearly over all blocks as timm's ``stagewise``).
        depths: blocks per stage. embed_dim, num_heads: the first stage's (doubled per stage) or
            one per stage. mlp_ratio, qkv_bias.
        expand_attn: widen in the attention (timm's default; ``mvitv2_large`` widens in the MLP).
        class_token: one class token (the ``*_cls`` variants); ``global_pool`` ``"token"`` (its
            default then) or ``"avg"`` (of the grid tokens).
        residual_pooling: ``"all"`` (timm), ``"grid"`` (torchvision's ``mvit_v2_s``: not the class
            token) or ``"none"``.
        kernel_qkv: pooling kernel side. stride_q: per-stage query stride (default 1 then 2s).
        stride_kv_adaptive: the key / value stride of stage 0, divided by each stage's query stride.
        attention: ``sdpa``, ``math`` or ``auto``. cpu_bf16_matmul: see :mod:`vitflow.models.kernels.matmul`.

    ``forward(x)``: ``(B, in_chans, H, W)`` float -> logits ``(B, num_classes)``.

    Raises:
        ValueError: inconsistent arguments (each names the argument).
    """

    supports_pruning = False  # vitflow prune slices a ViT's fused qkv / fc1; MViT's widths change per stage
    pos_embed_type = "relative"

    def __init__(self, img_size: int = 224, patch_size: int = 4, in_chans: int = 3, num_classes: int = 1000,
                 depths: Sequence[int] = (1, 2, 5, 2), embed_dim: int | Sequence[int] = 96,
                 num_heads: int | Sequence[int] = 1, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 expand_attn: bool = True, class_token: bool = False, global_pool: str | None = None,
                 residual_pooling: str = "all", kernel_qkv: int = 3, stride_q: Sequence[int] | None = None,
                 stride_kv_adaptive: int = 4, patch_kernel: int | None = None, drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, attention: str = "sdpa", cpu_bf16_matmul: str = "auto"):
        super().__init__()
        layout = stage_layout(depths, embed_dim, num_heads, stride_q, stride_kv_adaptive, expand_attn)
        self.global_pool = _check_args(img_size, patch_size, class_token, global_pool, residual_pooling)
        self.img_size, self.patch_size, self.in_chans, self.num_classes = img_size, patch_size, in_chans, num_classes
        self.depths, self.num_prefix_tokens, self.drop_rate = tuple(depths), int(class_token), drop_rate
        self.embed_dim = layout.dims[0]
        kernel = patch_kernel or 2 * patch_size - 1
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(in_chans, layout.dims[0], kernel, patch_size, kernel // 2)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, layout.dims[0])) if class_token else None
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        size, dim, stages, first = pooled_size(img_size, kernel, patch_size), layout.dims[0], [], 0
        for i, depth in enumerate(depths):
            # timm: without expand_attn a stage's last block widens to the next stage's width
            dim_out, blocks = layout.dims[i if expand_attn else min(i + 1, len(depths) - 1)], []
            out_dims = (dim_out,) * depth if expand_attn else (dim,) * (depth - 1) + (dim_out,)
            for j in range(depth):
                sq = layout.stride_q[i] if j == 0 else 1
                blocks.append(MultiScaleBlock(
                    dim, out_dims[j], layout.heads[i], (size, size), mlp_ratio, qkv_bias, dpr[first + j],
                    (kernel_qkv,) * 2, (kernel_qkv,) * 2, (sq, sq), (layout.stride_kv[i],) * 2, class_token,
                    expand_attn, residual_pooling, attention))
                dim = out_dims[j]
                if j == 0:
                    size //= layout.stride_q[i]
            stages.append(MViTStage(blocks))
            first += depth
        self.stages = nn.ModuleList(stages)
        self.num_features = dim
        self.norm = LayerNorm(dim, eps=LN_EPS)
        self.head = MViTHead(dim, num_classes, drop_rate)
        self.checkpoint_plan = CheckpointPlan()
        self.cpu_bf16_matmul = "auto"
        self.init_weights()
        self.set_cpu_bf16_matmul(cpu_bf16_matmul)

    def init_weights(self) -> None:
        """timm's: truncated normal (std 0.02) linears and class token, zero biases;
        relative tables as built; convolutions and norms PyTorch's defaults."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    @property
    def blocks(self) -> list[MultiScaleBlock]:
        """Every block of every stage in order (a plain list; the state_dict keeps timm's
        ``stages.{i}.blocks.{j}`` names)."""
        return [blk for stage in self.stages for blk in stage.blocks]

    def layer_id(self, name: str) -> int:
        """Depth of parameter ``name`` for layer-wise lr decay: 0 for the patch embedding and class
        token, ``k + 1`` for the ``k``-th block over all stages, ``len(blocks) + 1`` for the final
        norm and the head."""
        if name.startswith(("patch_embed", "cls_token")):
            return 0
        parts = name.split(".")
        if parts[0] != "stages":
            return len(self.blocks) + 1
        return sum(self.depths[:int(parts[1])]) + int(parts[3]) + 1

    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Pixels ``(B, C, H, W)`` -> tokens ``(B, prefix + h*w, embed_dim)`` and the grid ``(h, w)``."""
        x = self.patch_embed.proj(x.contiguous(memory_format=torch.channels_last))
        grid = (x.shape[-2], x.shape[-1])
        x = x.permute(0, 2, 3, 1).reshape(x.shape[0], grid[0] * grid[1], -1)  # channels last: no copy
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x), dim=1)
        return x, grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens ``(B, prefix + h*w, num_features)`` after the final norm."""
        x, grid = self.embed(x)
        if self.checkpoint_plan.mode == "auto" and torch.is_grad_enabled():
            plan_mvit_checkpointing(self, x, grid)
        for stage in self.stages:
            x, grid = stage(x, grid)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens -> logits ``(B, num_classes)`` (pooled ``(B, num_features)`` with ``pre_logits``)."""
        x = x[:, self.num_prefix_tokens:].mean(1) if self.global_pool == "avg" else x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names kept out of weight decay beside 1-D parameters: the relative tables and the class
        token (timm's ``no_weight_decay``)."""
        keys = ("rel_pos_h", "rel_pos_w", "cls_token")
        return {n for n, _ in self.named_parameters() if any(k in n for k in keys)}

    def attention_maps(self, x: torch.Tensor, layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per-block attention placed on each block's own (query) grid: one float32
        ``(B, heads, P + h*w, P + h*w)`` per requested block (indices over all stages, negative
        from the end, ``None`` = all), ``h x w`` the block's output grid (:meth:`attention_grid`),
        ``P`` the class tokens, grid tokens row-major. A block's keys sit on its pooled key grid
        (:meth:`key_grid`); each key's probability is spread over the query-grid cells its region
        overlaps (in proportion to the overlap: :func:`grid_transfer`), so rows still sum to 1
        and blocks of one stage share a grid (attention rollout within a stage). Explicit
        softmax whatever the backend.

        Raises:
            IndexError: a layer index out of range.
        """
        wanted = wanted_layers(layers, len(self.blocks))
        maps = {}
        x, grid = self.embed(x)
        p = self.num_prefix_tokens
        for k, blk in enumerate(self.blocks[:max(wanted) + 1]):
            if k in wanted:
                probs = blk.probs(x, grid)
                q_grid, k_grid = blk.attn.grids(grid)
                t = grid_transfer(k_grid, q_grid, probs.device)
                spread = probs[..., p:] @ t
                maps[k] = torch.cat((probs[..., :p], spread), dim=-1) if p else spread
            x, grid = blk(x, grid)
        return [maps[i] for i in wanted]

    def _grids(self, img_size: tuple[int, int] | None) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per block, its query (output) grid and key grid for an input of ``img_size`` pixels."""
        h, w = img_size or (self.img_size, self.img_size)
        conv = self.patch_embed.proj
        grid = tuple(pooled_size(s, conv.kernel_size[0], conv.stride[0]) for s in (h, w))
        out = []
        for blk in self.blocks:
            out.append(blk.attn.grids(grid))
            grid = out[-1][0]
        return out

    def attention_grid(self, layer: int, img_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The query grid ``(h, w)`` of block ``layer``'s attention maps for an input of
        ``img_size`` ``(H, W)`` pixels (default the model's)."""
        return self._grids(img_size)[layer][0]

    def key_grid(self, layer: int, img_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The pooled key grid ``(h, w)`` of block ``layer`` (see :meth:`attention_grid`)."""
        return self._grids(img_size)[layer][1]


def _overlap(src: int, dst: int) -> torch.Tensor:
    """``(src, dst)``: the fraction of source cell ``a`` (of ``src`` equal cells on [0, 1)) that lies in
    destination cell ``i`` (of ``dst``); rows sum to 1."""
    edges_s = torch.arange(src + 1, dtype=torch.float64) / src
    edges_d = torch.arange(dst + 1, dtype=torch.float64) / dst
    lo = torch.maximum(edges_s[:-1, None], edges_d[None, :-1])
    hi = torch.minimum(edges_s[1:, None], edges_d[None, 1:])
    return (hi - lo).clamp_min(0) * src


def grid_transfer(src: tuple[int, int], dst: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """float32 ``(sh*sw, dh*dw)``: how much of each cell of grid ``src`` falls in each cell of grid
    ``dst`` (both covering the image; row-major); rows sum to 1. ``probs @ T`` moves attention over
    keys on ``src`` onto ``dst``."""
    t = torch.einsum("ai,bj->abij", _overlap(src[0], dst[0]), _overlap(src[1], dst[1]))
    return t.reshape(src[0] * src[1], dst[0] * dst[1]).float().to(device)


def _check_args(img_size: int, patch_size: int, class_token: bool, global_pool: str | None,
                residual_pooling: str) -> str:
    """The resolved ``global_pool``; ValueError naming a bad argument."""
    if img_size < patch_size or patch_size < 1:
        raise ValueError(f"img_size {img_size} must be at least patch_size {patch_size} (>= 1)")
    pool = global_pool or ("token" if class_token else "avg")
    if pool not in ("avg", "token") or (pool == "token" and not class_token):
        raise ValueError(f"global_pool={global_pool!r} is not available for this MViT: avg, or token with a class "
                         "token (the *_cls variants)")
    if residual_pooling not in ("all", "grid", "none"):
        raise ValueError(f"residual_pooling must be all, grid or none, got {residual_pooling!r}")
    return pool
