"""Swin Transformer (Liu et al. 2021) and Swin V2 (Liu et al. 2022) with timm's parameter names.

Layout (timm's ``SwinTransformer`` / ``SwinTransformerV2``): ``patch_embed`` (``proj`` conv,
``norm``) -> ``layers.{i}`` stages (``downsample``: patch merging, stages > 0; ``blocks.{j}``:
:class:`~vitflow.models.swin.block.SwinBlock`, odd blocks on shifted windows) -> ``norm`` ->
``head`` (``fc``, average pool over the grid). Features are NHWC: ``forward_features`` returns
``(B, H', W', C)`` as timm's. A timm state_dict of the same name loads with ``strict=True`` (all
buffers are rebuilt, none is saved).

Inputs of other sizes (multiples of the patch size) run with the windows fixed at construction
(``img_size`` / ``window_size``), grids padded to whole windows and masks made per size.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from vitflow.models.block import wanted_layers
from vitflow.models.encoder import StageControls
from vitflow.models.grad_checkpointing import CheckpointPlan
from vitflow.models.layers import LayerNorm, classifier_head
from vitflow.models.swin.block import PatchMerging, SwinBlock
from vitflow.models.swin.plan import plan_swin_checkpointing

log = logging.getLogger(__name__)


class SwinPatchEmbed(nn.Module):
    """Non-overlapping patches: ``(B, C, H, W)`` -> ``(B, H/p, W/p, D)`` (conv ``proj``, then
    ``norm``). Raises ValueError for a side that is not a multiple of the patch size."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if not torch.jit.is_tracing() and (h % self.patch_size or w % self.patch_size):
            raise ValueError(f"input size {h}x{w} is not a multiple of patch size {self.patch_size}")
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class SwinStage(nn.Module):
    """``downsample`` (patch merging or identity) then ``blocks``; ``(B, H, W, C)`` in and out."""

    def __init__(self, downsample: nn.Module, blocks: Sequence[SwinBlock]):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        recompute = torch.is_grad_enabled()
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if recompute and blk.grad_checkpointing else blk(x)
        return x


class SwinHead(nn.Module):
    """timm's ``ClassifierHead`` on NHWC features: average over the grid, dropout, ``fc``."""

    def __init__(self, num_features: int, num_classes: int, drop: float = 0.0, gemm: str = "auto"):
        super().__init__()
        self.drop = nn.Dropout(drop)
        self.fc = classifier_head(num_features, num_classes, gemm)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.drop(x.mean(dim=(1, 2)))
        return x if pre_logits else self.fc(x)


class SwinTransformer(StageControls, nn.Module):
    """Swin (``version=1``) or Swin V2 (``version=2``) image classifier.

    Args:
        img_size: input side in pixels the windows are fitted to (timm's rule: a window larger
            than a stage's grid shrinks to it and does not shift).
        patch_size, in_chans, num_classes (0: no head), embed_dim (first stage's width, doubled
            per stage), depths, num_heads (per stage), window_size, mlp_ratio, qkv_bias.
        pretrained_window_sizes: V2's coordinate normalisation per stage (0: the window).
        drop_rate, attn_drop_rate, drop_path_rate (linear over all blocks).
        global_pool: ``"avg"`` only (timm's).
        attention: window backend ``sdpa`` | ``math`` | ``auto``.
        cpu_bf16_matmul: see :mod:`vitflow.models.kernels.matmul`.

    ``forward(x)``: ``(B, in_chans, H, W)`` float, ``H``, ``W`` multiples of ``patch_size`` ->
    logits ``(B, num_classes)``.

    Raises:
        ValueError: inconsistent arguments (each names the argument).
    """

    supports_pruning = False  # vitflow prune slices a ViT's fused qkv / fc1; a Swin has per-stage heads
    num_prefix_tokens = 0
    pos_embed_type = "relative"

    def __init__(self, img_size: int = 224, patch_size: int = 4, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 96, depths: Sequence[int] = (2, 2, 6, 2), num_heads: Sequence[int] = (3, 6, 12, 24),
                 window_size: int = 7, mlp_ratio: float = 4.0, qkv_bias: bool = True, version: int = 1,
                 pretrained_window_sizes: Sequence[int] | None = None, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, global_pool: str = "avg",
                 attention: str = "sdpa", cpu_bf16_matmul: str = "auto"):
        super().__init__()
        if isinstance(depths, int) or isinstance(num_heads, int):
            raise ValueError(f"depths={depths!r}, num_heads={num_heads!r}: a Swin's depths and heads are per stage, "
                             "one number each (e.g. depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))")
        depths, num_heads = tuple(depths), tuple(num_heads)
        _check_args(img_size, patch_size, depths, num_heads, window_size, version, global_pool)
        pretrained = tuple(pretrained_window_sizes or (0,) * len(depths))
        self.img_size, self.patch_size, self.in_chans, self.version = img_size, patch_size, in_chans, version
        self.num_classes, self.embed_dim, self.global_pool = num_classes, embed_dim, global_pool
        self.depths, self.window_size = depths, window_size
        self.num_features = embed_dim * 2 ** (len(depths) - 1)
        self.patch_embed = SwinPatchEmbed(patch_size, in_chans, embed_dim)
        dpr = torch.linspace(0, drop_path_rate, sum(depths)).tolist()
        grid, stages, first = img_size // patch_size, [], 0
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            dim = embed_dim * 2**i
            if i:
                grid = -(-grid // 2)
            down = PatchMerging(dim // 2, dim, version) if i else nn.Identity()
            blocks = [SwinBlock(dim, heads, (grid, grid), window_size, j % 2 == 1, mlp_ratio, qkv_bias, drop_rate,
                                attn_drop_rate, dpr[first + j], version, pretrained[i], attention)
                      for j in range(depth)]
            stages.append(SwinStage(down, blocks))
            first += depth
        self.layers = nn.Sequential(*stages)
        self.norm = LayerNorm(self.num_features)
        self.head = SwinHead(self.num_features, num_classes, drop_rate)
        self.checkpoint_plan = CheckpointPlan()
        self.cpu_bf16_matmul = "auto"
        self.init_weights()
        self.set_cpu_bf16_matmul(cpu_bf16_matmul)

    def init_weights(self) -> None:
        """timm's: truncated normal (std 0.02) linears with zero biases, V1 bias tables std 0.02,
        V2 logit scales ``ln 10`` and zero q / v biases; norms at 1 / 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for blk in self.blocks:
            if self.version == 1:
                nn.init.trunc_normal_(blk.attn.relative_position_bias_table, std=0.02)

    @property
    def blocks(self) -> list[SwinBlock]:
        """Every block of every stage in order (a plain list: the state_dict keeps timm's
        ``layers.{i}.blocks.{j}`` names)."""
        return [blk for stage in self.layers for blk in stage.blocks]

    def layer_id(self, name: str) -> int:
        """Depth of parameter ``name`` for layer-wise lr decay: 0 for the patch embedding,
        ``k + 1`` for the ``k``-th block over all stages (a stage's patch merging goes with its
        first block), ``len(blocks) + 1`` for the final norm and the head."""
        if name.startswith("patch_embed"):
            return 0
        parts = name.split(".")
        if parts[0] != "layers":
            return len(self.blocks) + 1
        first = sum(self.depths[:int(parts[1])])
        return first + (int(parts[3]) if parts[2] == "blocks" else 0) + 1

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> NHWC features ``(B, H', W', num_features)`` after the final norm."""
        x = self.patch_embed(x)
        if self.checkpoint_plan.mode == "auto" and torch.is_grad_enabled():
            plan_swin_checkpointing(self, x)
        return self.norm(self.layers(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """NHWC features -> logits ``(B, num_classes)`` (pooled ``(B, num_features)`` with ``pre_logits``)."""
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Names kept out of weight decay beside 1-D parameters: V1 bias tables, V2 ``cpb_mlp``
        and ``logit_scale`` (timm's ``no_weight_decay`` keywords)."""
        keys = ("relative_position_bias_table", "cpb_mlp", "logit_scale")
        return {n for n, _ in self.named_parameters() if any(k in n for k in keys)}

    def attention_maps(self, x: torch.Tensor, layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per-block attention placed back on each block's own grid: one float32
        ``(B, heads, h*w, h*w)`` per requested block (indices over all stages, negative from
        the end, ``None`` = all), ``h x w`` that block's stage grid, tokens row-major; zero
        outside each query's window (:meth:`SwinBlock.probs`). Explicit softmax whatever the
        backend.

        Raises:
            IndexError: a layer index out of range.
        """
        wanted = wanted_layers(layers, len(self.blocks))
        maps, k = {}, 0
        x = self.patch_embed(x)
        for stage in self.layers:
            x = stage.downsample(x)
            for blk in stage.blocks:
                if k in wanted:
                    maps[k] = blk.probs(x)
                x, k = blk(x), k + 1
            if k > max(wanted):
                break
        return [maps[i] for i in wanted]

    def attention_grid(self, layer: int, img_size: tuple[int, int] | None = None) -> tuple[int, int]:
        """The token grid ``(h, w)`` of block ``layer``'s attention maps for an input of
        ``img_size`` ``(H, W)`` pixels (default the model's)."""
        h, w = img_size or (self.img_size, self.img_size)
        h, w = h // self.patch_size, w // self.patch_size
        stage = next(i for i, end in enumerate(torch.tensor(self.depths).cumsum(0).tolist()) if layer % sum(self.depths) < end)
        for _ in range(stage):
            h, w = -(-h // 2), -(-w // 2)
        return h, w


def _check_args(img_size: int, patch_size: int, depths: tuple, num_heads: tuple, window_size: int, version: int,
                global_pool: str) -> None:
    if img_size % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
    if len(depths) != len(num_heads) or not depths:
        raise ValueError(f"depths {depths} and num_heads {num_heads} must name the same number of stages")
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    if version not in (1, 2):
        raise ValueError(f"version must be 1 (Swin) or 2 (Swin V2), got {version}")
    if global_pool != "avg":
        raise ValueError(f"global_pool={global_pool!r} is not available for Swin models: they average the grid "
                         "(no class token)")
