"""The BEiT / EVA-02 / DINOv3 encoder: one ViT layout with timm's ``Beit`` / ``Eva`` parameter names.

BEiT (Bao et al. 2022), EVA-02 (Fang et al. 2023) and DINOv3 (Simeoni et al. 2025) share timm's
``Eva`` / ``Beit`` layout: ``patch_embed.proj``, ``cls_token``, ``reg_token`` (registers, Darcet
et al. 2024), ``pos_embed`` (learned, also covering the prefix tokens), ``rope`` (no parameters),
``blocks.{i}`` (:mod:`vitflow.models.eva.block`), ``norm`` or ``fc_norm``, ``head``. What differs is
configuration: the position encoding (BEiT: relative bias per block; EVA-02: learned + RoPE;
DINOv3: RoPE only), the MLP (GELU, SwiGLU, SwiGLU with sub-LN), LayerScale, registers and the
pooling. A timm state_dict of the same name loads with ``strict=True``.

The forward reads as the math: patch embedding -> prefix tokens and positions -> blocks -> norm
-> pool -> head. Other input sizes (multiples of the patch size): the learned position embedding
is resampled bicubically (as timm's ``dynamic_img_size``), RoPE is computed for the grid, BEiT's
bias tables are resampled (:func:`vitflow.models.position.resample_relative_table`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from vitflow.models.autotune import per_shape_choices
from vitflow.models.block import Blocks
from vitflow.models.encoder import EncoderControls
from vitflow.models.eva.block import EvaAttention, EvaBlock, EvaSplitAttention
from vitflow.models.eva.glu import PackedSwiGLU, SwiGLU
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import Mlp, PatchEmbed
from vitflow.models.position import resample_pos_embed
from vitflow.models.rope import Rope2d

MLPS = ("gelu", "swiglu_packed", "swiglu")


class Eva(EncoderControls, nn.Module):
    """BEiT / EVA-02 / DINOv3 image classifier (see the module docstring).

    Args:
        img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads, mlp_ratio: as
            :class:`~vitflow.models.vit.model.VisionTransformer` (``num_classes=0``: no head).
        mlp: ``"gelu"`` (``fc1``/``fc2``), ``"swiglu_packed"`` (timm's ``GluMlp``: hidden doubled in
            ``fc1``) or ``"swiglu"`` (``fc1_g``/``fc1_x``/``fc2``).
        sub_ln: LayerNorm on the MLP's hidden units (EVA-02 ``scale_mlp``; needs ``swiglu``).
        swiglu_align_to: round the SwiGLU width up to a multiple (DINOv3 "plus" models).
        attn_inner_norm: LayerNorm on the attention output before ``proj`` (EVA-02 CLIP).
        qkv_bias: ``q_bias`` / ``v_bias``; qkv_fused: one ``qkv`` linear, else three.
        global_pool: ``"avg"`` (patch tokens, prefix excluded) or ``"token"`` (class token).
        use_fc_norm: norm after pooling (``fc_norm``) instead of before (``norm``); ``None``:
            ``global_pool == "avg"`` (timm's default).
        class_token, num_reg_tokens: prefix tokens (class first, then registers).
        abs_pos_embed: a learned ``pos_embed`` over prefix and patch tokens.
        rel_pos_bias: BEiT's per-block relative position bias (needs the class token, no registers).
        rope, rope_temperature, rope_ref_grid: 2-D RoPE kind (``"eva"`` / ``"dinov3"`` / ``None``).
        layer_scale_init: LayerScale ``gamma_1``/``gamma_2`` initial value; ``None``: none.
        norm_eps: LayerNorm epsilon (1e-6; DINOv3 1e-5).
        drop_rate, attn_drop_rate, drop_path_rate: dropout after positions / in the MLP and
            attention output / before the head, on attention probabilities, stochastic depth.
        attention, attn_block_size: backend (``sdpa``, ``math``, ``blockwise``, ``auto``).
        cpu_bf16_matmul: see :mod:`vitflow.models.kernels.matmul`.

    ``forward(x)``: ``(B, in_chans, H, W)`` float -> logits ``(B, num_classes)``.

    Raises:
        ValueError: inconsistent arguments (each names the argument).
    """

    supports_pruning = False  # vitflow prune slices the ViT family's fused qkv / fc1 only (infer.prune refuses)

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 mlp: str = "gelu", sub_ln: bool = False, swiglu_align_to: int = 0, attn_inner_norm: bool = False,
                 qkv_bias: bool = True, qkv_fused: bool = True, global_pool: str = "avg",
                 use_fc_norm: bool | None = None, class_token: bool = True, num_reg_tokens: int = 0,
                 abs_pos_embed: bool = True, rel_pos_bias: bool = False, rope: str | None = None,
                 rope_temperature: float = 10000.0, rope_ref_grid: tuple[int, int] | None = None,
                 layer_scale_init: float | None = None, norm_eps: float = 1e-6, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, attention: str = "sdpa",
                 attn_block_size: int = 128, cpu_bf16_matmul: str = "auto"):
        super().__init__()
        _check_args(img_size, patch_size, mlp, sub_ln, global_pool, class_token, num_reg_tokens, rel_pos_bias)
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.num_classes, self.embed_dim, self.global_pool = num_classes, embed_dim, global_pool
        self.num_features = embed_dim
        self.grid_size = img_size // patch_size
        self.num_prefix_tokens = int(class_token) + num_reg_tokens
        self.pos_embed_type = "learned" if abs_pos_embed else "relative" if rel_pos_bias else "rope"
        self.attention_options = dict(block_size=attn_block_size)
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, num_reg_tokens, embed_dim)) if num_reg_tokens else None
        tokens = self.grid_size**2 + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, embed_dim)) if abs_pos_embed else None
        self.pos_drop = nn.Dropout(drop_rate)
        self.rope = (Rope2d(rope, embed_dim // num_heads, self.num_prefix_tokens, rope_temperature, rope_ref_grid)
                     if rope else None)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = Blocks(*[self._block(embed_dim, num_heads, mlp_ratio, mlp, sub_ln, swiglu_align_to,
                                           attn_inner_norm, qkv_bias, qkv_fused, rel_pos_bias, layer_scale_init,
                                           norm_eps, drop_rate, attn_drop_rate, dpr[i], attention)
                               for i in range(depth)])
        fc_norm = global_pool == "avg" if use_fc_norm is None else use_fc_norm
        self.norm = nn.Identity() if fc_norm else nn.LayerNorm(embed_dim, eps=norm_eps)
        self.fc_norm = nn.LayerNorm(embed_dim, eps=norm_eps) if fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.set_cpu_bf16_matmul(cpu_bf16_matmul)
        self.init_weights()
        self.blocks.register_forward_pre_hook(per_shape_choices)

    def _block(self, dim: int, heads: int, mlp_ratio: float, mlp: str, sub_ln: bool, align_to: int,
               inner_norm: bool, qkv_bias: bool, fused: bool, rel_pos: bool, ls_init: float | None,
               eps: float, drop: float, attn_drop: float, drop_path: float, attention: str) -> EvaBlock:
        attn_cls = EvaAttention if fused else EvaSplitAttention
        attn = attn_cls(dim, heads, qkv_bias, attn_drop=attn_drop, proj_drop=drop,
                        grid=(self.grid_size, self.grid_size), num_prefix_tokens=self.num_prefix_tokens,
                        rel_pos=rel_pos, rope=self.rope, inner_norm_eps=eps if inner_norm else None,
                        backend=attention, backend_options=self.attention_options)
        hidden = int(dim * mlp_ratio)
        if mlp == "gelu":
            ffn = Mlp(dim, hidden, drop)
        elif mlp == "swiglu_packed":
            ffn = PackedSwiGLU(dim, hidden, drop)
        else:
            ffn = SwiGLU(dim, hidden, drop, norm_eps=eps if sub_ln else None, align_to=align_to)
        return EvaBlock(dim, attn, ffn, eps, ls_init, drop_path)

    def init_weights(self) -> None:
        """timm's BEiT / EVA initialisation: truncated normal (std 0.02) for linears, position
        embedding and prefix tokens, zero biases (q/v bias and relative tables too), unit
        LayerNorms, the output projections of block ``i`` divided by ``sqrt(2 (i + 1))``, and the
        head scaled by 0.001."""
        for t in (self.pos_embed, self.cls_token, self.reg_token):
            if t is not None:
                nn.init.trunc_normal_(t, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            for i, blk in enumerate(self.blocks):
                blk.attn.proj.weight.div_(math.sqrt(2.0 * (i + 1)))
                blk.mlp.fc2.weight.div_(math.sqrt(2.0 * (i + 1)))
            if isinstance(self.head, nn.Linear):
                self.head.weight.mul_(0.001)

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images -> tokens ``(B, P + h*w, D)`` with prefix tokens and positions, and the grid."""
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        x = self.patch_embed(x)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        if self.pos_embed is not None:
            pos = self.pos_embed
            if grid != (self.grid_size, self.grid_size):
                pos = resample_pos_embed(pos, grid, self.num_prefix_tokens)
            x = x + pos
        return self.pos_drop(x), grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens ``(B, P + h*w, D)`` after the final norm (class token first,
        then the registers)."""
        x, grid = self._embed(x)
        return self.norm(self.blocks(x, grid))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens ``(B, N, D)`` -> logits ``(B, num_classes)`` (or pooled ``(B, D)`` if ``pre_logits``)."""
        x = x[:, 0] if self.global_pool == "token" else x[:, self.num_prefix_tokens:].mean(dim=1)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def attention_maps(self, x: torch.Tensor, layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per-layer attention probabilities, one float32 ``(B, H, N, N)`` per requested block
        (negative indices count from the end; ``None`` = all), computed explicitly whatever the
        backend; token order: class, registers, patches. Raises IndexError for a bad index."""
        x, grid = self._embed(x)
        return self.blocks.attention_maps(x, grid, layers)


def _check_args(img_size: int, patch_size: int, mlp: str, sub_ln: bool, global_pool: str, class_token: bool,
                num_reg_tokens: int, rel_pos_bias: bool) -> None:
    if img_size % patch_size:
        raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
    if mlp not in MLPS:
        raise ValueError(f"mlp must be one of {', '.join(MLPS)}, got {mlp!r}")
    if sub_ln and mlp != "swiglu":
        raise ValueError("sub_ln (a norm inside the MLP) needs mlp='swiglu'")
    if global_pool not in ("token", "avg"):
        raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool='token' needs the class token")
    if rel_pos_bias and (not class_token or num_reg_tokens):
        raise ValueError("the relative position bias needs exactly one prefix token (the class token)")
