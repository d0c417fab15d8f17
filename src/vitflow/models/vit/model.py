"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}.norm1``, ``.attn.qkv``, ``.attn.proj``, ``.ls1.gamma``, ``.norm2``,
``.mlp.fc1``, ``.mlp.fc2``, ``.ls2.gamma``, ``norm`` / ``fc_norm``, ``head``; ``reg_token``,
``norm_pre``, ``attn_pool.*`` for the pretrained families) so that a timm state_dict of the same
configuration loads with ``strict=True``. The forward reads as the math: patch embedding ->
class / register tokens and positions -> [pre-norm] -> blocks -> norm -> pool -> head.

Beside the original ViT this one class covers the pretrained backbones that share timm's
``VisionTransformer`` layout (:mod:`vitflow.models.vit.pretrained`): DeiT III (position
embedding without the class token, LayerScale), DINOv2 with and without registers (Darcet et al.
2024, "Vision Transformers Need Registers"), CLIP image towers (pre-norm, no patch bias,
QuickGELU) and SigLIP towers (no class token, attention-pooling head, :mod:`vitflow.models.pool`). The blocks are in
:mod:`vitflow.models.block` (attention math in :mod:`vitflow.models.attention`), the small layers
in :mod:`vitflow.models.layers`, position encodings in :mod:`vitflow.models.position`; choices
that depend on the input's shape are made once per shape by :mod:`vitflow.models.autotune`.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn as nn

from vitflow.models.autotune import per_shape_choices
from vitflow.models.block import Attention, Block, Blocks
from vitflow.models.encoder import EncoderControls
from vitflow.models.kernels.matmul import Linear
from vitflow.models.layers import LN_EPS, PatchDropout, PatchEmbed
from vitflow.models.pool import AttentionPoolLatent, pool_tokens
from vitflow.models.position import resample_pos_embed, sincos_2d
from vitflow.models.token_merging import check_mergeable, merge_schedule, merge_through
from vitflow.models.vit.checks import check_options

__all__ = ["Attention", "Block", "VisionTransformer", "resample_pos_embed"]


class VisionTransformer(EncoderControls, nn.Module):
    """ViT image classifier.

    Args:
        img_size: training resolution in pixels (square); fixes the position-embedding grid.
        patch_size: patch side in pixels.
        in_chans: input channels.
        num_classes: classifier outputs; 0 gives ``head = Identity`` (features only).
        embed_dim: token width.
        depth: number of blocks.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width / ``embed_dim``.
        qkv_bias: bias on the qkv projection.
        global_pool: ``"token"`` (class token, as in ViT), ``"avg"`` (mean of the patch tokens;
            ``fc_norm`` instead of ``norm`` unless ``fc_norm=False``, as in timm / MAE) or ``"map"``
            (attention pooling, :class:`~vitflow.models.pool.AttentionPoolLatent`, SigLIP).
        drop_rate: dropout on activations.
        attn_drop_rate: dropout on attention probabilities.
        drop_path_rate: stochastic-depth rate of the last block, rising linearly from 0.
        attention: attention backend (:data:`vitflow.models.attention.BACKENDS`).
        pos_embed: ``"learned"`` (parameter ``pos_embed``, resampled bicubically for another
            grid), ``"sincos2d"`` (fixed) or ``"relative"`` (per-head bias in every block, no
            absolute embedding); see :mod:`vitflow.models.position`.
        layer_scale_init: LayerScale initial value (e.g. 1e-5); ``None`` = no LayerScale.
        attn_block_size: ``blockwise`` key-block size.
        attn_window: ``local`` window radius in patches.
        linformer_k: Linformer projected length (default tokens // 4).
        performer_features: Performer random features (default ``round(d ln d)``).
        block_heads: per-block head counts (length ``depth``) for pruned models
            (:mod:`vitflow.infer.prune`); ``None`` gives every block ``num_heads`` heads of
            ``embed_dim // num_heads`` (the timm layout). Pruned blocks keep the unpruned head
            dimension.
        block_mlp_hidden: per-block MLP hidden sizes (length ``depth``) for pruned models;
            ``None`` gives every block ``int(embed_dim * mlp_ratio)`` hidden units.
        patch_drop_rate: fraction of patch tokens dropped per sample in training (:class:`PatchDropout`;
            needs an attention that takes any token set: no ``relative`` position bias, no sparse pattern).
        weight_init: ``"timm"`` (timm's default) or ``"jax"`` (the original JAX / big_vision scheme,
            timm's ``weight_init="jax"``: zero head; see :meth:`init_weights`).
        cpu_bf16_matmul: under bf16 autocast on the CPU, the GEMM of the linear layers:
            ``bf16`` (oneDNN's), ``fp32`` (the same bf16-rounded operands through the fp32 GEMM) or
            ``auto`` (timed per shape); see :mod:`vitflow.models.kernels.matmul`.
        class_token: prepend a learned class token (``cls_token``); ``None`` (vitflow's default) =
            only when ``global_pool == "token"`` (timm's default is ``True``).
        reg_tokens: learned register tokens after the class token (``reg_token (1, R, D)``;
            DINOv2-reg, Darcet et al. 2024); they attend and are attended to, and are left out of
            pooling and of the patch grid.
        no_embed_class: the position embedding covers the patch grid only; the class / register
            tokens get none (DeiT III, DINOv2-reg, big_vision).
        pre_norm: a LayerNorm (``norm_pre``) on the embedded tokens before the blocks, and a patch
            embedding without bias (CLIP).
        fc_norm: LayerNorm after pooling (``fc_norm``) instead of on the tokens (``norm``);
            ``None`` = only for ``global_pool="avg"`` (timm's rule); SigLIP's gap towers use
            ``avg`` with ``fc_norm=False``.
        act_layer: MLP activation: ``"gelu"``, ``"gelu_tanh"`` or ``"quick_gelu"`` (CLIP).
        norm_eps: epsilon of every LayerNorm (1e-6; OpenAI / OpenCLIP towers 1e-5).
        mlp_layer: ``"mlp"`` or ``"swiglu_packed"`` (fc1 holds value and gate, DINOv2-giant; the
            hidden width ``int(embed_dim * mlp_ratio)`` is fc1's).
        truncate_patches: an image side that is not a multiple of the patch drops its last pixels
            (timm's patch embedding; SigLIP so400m/14 at 384) instead of being refused.
        token_merge: token merging (ToMe, Bolya et al. 2023; :mod:`vitflow.models.token_merging`):
            patch tokens merged in every block (an int, 0 = off) or one count per block; see
            :meth:`set_token_merge`.

    Tokens: ``[cls?, reg * R, patches...]``; ``num_prefix_tokens = cls + R``.

    ``forward(x)``: ``(B, in_chans, H, W)`` float -> logits ``(B, num_classes)``; H and W may
    differ from ``img_size`` (multiples of the patch size): the position encoding follows.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, global_pool: Literal["token", "avg", "map"] = "token", drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, attention: str = "sdpa",
                 pos_embed: str = "learned", layer_scale_init: float | None = None, attn_block_size: int = 128,
                 attn_window: int = 3, linformer_k: int | None = None, performer_features: int | None = None,
                 block_heads: list[int] | None = None, block_mlp_hidden: list[int] | None = None,
                 patch_drop_rate: float = 0.0, weight_init: Literal["timm", "jax"] = "timm",
                 cpu_bf16_matmul: Literal["auto", "bf16", "fp32"] = "auto", class_token: bool | None = None,
                 reg_tokens: int = 0, no_embed_class: bool = False, pre_norm: bool = False,
                 fc_norm: bool | None = None, act_layer: str = "gelu", norm_eps: float = LN_EPS,
                 mlp_layer: str = "mlp", truncate_patches: bool = False, token_merge: int | list[int] = 0):
        super().__init__()
        class_token = global_pool == "token" if class_token is None else class_token
        check_options(img_size, patch_size, global_pool, pos_embed, class_token, reg_tokens, no_embed_class,
                      act_layer, mlp_layer, depth, block_heads, block_mlp_hidden, truncate_patches)
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.num_classes, self.embed_dim, self.global_pool = num_classes, embed_dim, global_pool
        self.grid_size = img_size // patch_size
        self.num_reg_tokens, self.no_embed_class = reg_tokens, no_embed_class
        self.num_prefix_tokens = int(class_token) + reg_tokens
        self.pos_embed_type = pos_embed
        self.attention_options = dict(block_size=attn_block_size, window=attn_window, linformer_k=linformer_k,
                                      performer_features=performer_features)
        grid = (self.grid_size, self.grid_size)
        self._build_embedding(in_chans, embed_dim, class_token, pre_norm, norm_eps, drop_rate, patch_drop_rate,
                              truncate_patches)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        head_dim = embed_dim // num_heads if block_heads is not None else None
        self.blocks = Blocks(*[
            Block(embed_dim, block_heads[i] if block_heads else num_heads, mlp_ratio, qkv_bias, drop_rate,
                  attn_drop_rate, dpr[i], attention, layer_scale_init,
                  block_mlp_hidden[i] if block_mlp_hidden else None, act_layer, norm_eps, mlp_layer,
                  head_dim=head_dim, grid=grid, num_prefix_tokens=self.num_prefix_tokens,
                  rel_pos=pos_embed == "relative", backend_options=self.attention_options)
            for i in range(depth)
        ])
        self._build_head(num_heads, mlp_ratio, global_pool == "avg" if fc_norm is None else fc_norm, norm_eps,
                         act_layer, drop_rate)
        self.set_cpu_bf16_matmul(cpu_bf16_matmul)
        self.token_merge: int | list[int] = 0
        self.set_token_merge(token_merge)
        self.init_weights(weight_init)
        self.blocks.register_forward_pre_hook(per_shape_choices)

    def _build_embedding(self, in_chans: int, dim: int, class_token: bool, pre_norm: bool, norm_eps: float,
                         drop_rate: float, patch_drop_rate: float, truncate: bool) -> None:
        """``patch_embed``, ``cls_token``, ``reg_token``, ``pos_embed``, dropouts, ``norm_pre``."""
        self.patch_embed = PatchEmbed(self.patch_size, in_chans, dim, bias=not pre_norm, truncate=truncate)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, self.num_reg_tokens, dim)) if self.num_reg_tokens else None
        grid, length = (self.grid_size, self.grid_size), self.grid_size**2 + self.pos_embed_prefix_tokens
        if self.pos_embed_type == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, length, dim))
        elif self.pos_embed_type == "sincos2d":
            self.register_buffer("pos_embed", sincos_2d(grid, dim, self.pos_embed_prefix_tokens), persistent=False)
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(drop_rate)
        self.patch_drop = PatchDropout(patch_drop_rate)
        self.norm_pre = nn.LayerNorm(dim, eps=norm_eps) if pre_norm else nn.Identity()

    def _build_head(self, num_heads: int, mlp_ratio: float, use_fc_norm: bool, norm_eps: float, act_layer: str,
                    drop_rate: float) -> None:
        """``norm`` (on the tokens) or ``fc_norm`` (after pooling), ``attn_pool`` for ``map``, ``head``."""
        dim = self.embed_dim
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(dim, eps=norm_eps)
        self.attn_pool = (AttentionPoolLatent(dim, num_heads, mlp_ratio, norm_eps, act_layer)
                          if self.global_pool == "map" else None)
        self.fc_norm = nn.LayerNorm(dim, eps=norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = Linear(dim, self.num_classes) if self.num_classes > 0 else nn.Identity()

    @property
    def pos_embed_prefix_tokens(self) -> int:
        """Prefix tokens the position embedding covers: 0 with ``no_embed_class``, else all of them
        (the count :func:`resample_pos_embed` keeps when resizing the grid)."""
        return 0 if self.no_embed_class else self.num_prefix_tokens

    def init_weights(self, mode: Literal["timm", "jax"] = "timm") -> None:
        """Initialise every parameter.

        ``timm`` (timm's default): truncated normal (std 0.02) for linears, zero biases.
        ``jax`` (the original ViT / big_vision code, timm's ``weight_init="jax"``): Xavier-uniform
        linears, MLP biases normal (std 1e-6), other biases zero, a zero head (every class starts
        equally likely), LeCun-normal patch embedding. Both: position embedding truncated normal
        (std 0.02), class and register tokens normal (std 1e-6), unit LayerNorms, the MAP latent
        truncated normal (std ``dim ** -0.5``).

        Raises:
            ValueError: unknown ``mode``.
        """
        if mode not in ("timm", "jax"):
            raise ValueError(f"weight_init must be 'timm' or 'jax', got {mode!r}")
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if mode == "timm":
                    nn.init.trunc_normal_(m.weight, std=0.02)
                elif name.startswith("head"):
                    nn.init.zeros_(m.weight)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=1e-6) if mode == "jax" and ".mlp." in name else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if mode == "jax":
            w = self.patch_embed.proj.weight
            std = (1.0 / w[0].numel()) ** 0.5 / 0.87962566103423978  # LeCun normal, truncated at 2 std
            nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)
            if self.patch_embed.proj.bias is not None:
                nn.init.zeros_(self.patch_embed.proj.bias)
        if self.attn_pool is not None:
            self.attn_pool.init_weights()

    def _positions(self, grid_hw: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The absolute position embedding for ``grid_hw`` (resampled / recomputed off the native grid)."""
        if grid_hw == (self.grid_size, self.grid_size):
            return self.pos_embed
        if self.pos_embed_type == "learned":
            return resample_pos_embed(self.pos_embed, grid_hw, self.pos_embed_prefix_tokens)
        return sincos_2d(grid_hw, self.embed_dim, self.pos_embed_prefix_tokens, device=device)

    def _pos_embed(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        absolute = self.pos_embed_type in ("learned", "sincos2d")  # "relative" biases the attention instead
        if absolute and self.no_embed_class:  # positions for the patches only, then the prefix tokens
            x = x + self._positions(grid_hw, x.device)
        x = torch.cat([*prefix, x], dim=1) if prefix else x
        if absolute and not self.no_embed_class:
            x = x + self._positions(grid_hw, x.device)
        return self.pos_drop(x)

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        return self._pos_embed(self.patch_embed(x), grid), grid

    def set_token_merge(self, r: int | Sequence[int]) -> None:
        """Token merging (ToMe, :mod:`vitflow.models.token_merging`): ``r`` patch tokens merged in
        every block (an int; 0 = off) or one count per block, capped at what each block can merge.
        Weights are unchanged. Raises ValueError: a model that cannot merge (relative position
        bias, approximate or sparse attention, ``map`` pooling) or a schedule of the wrong length."""
        r = int(r) if isinstance(r, int) else [int(v) for v in r]
        if not (r if isinstance(r, int) else any(r)):
            self.token_merge = 0
            return
        check_mergeable(self)
        merge_schedule(r, len(self.blocks), self.grid_size**2)
        self.token_merge = r

    def forward_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images ``(B, C, H, W)`` -> ``(tokens (B, N, D) after the final norm, sizes)``: ``sizes``
        ``(B, N, 1)``, how many patches each token holds when tokens were merged (what
        :meth:`forward_head` weighs the mean of the patches by), else ``None``."""
        x, grid = self._embed(x)
        x = self.patch_drop(x, self.num_prefix_tokens)
        x = self.norm_pre(x)
        if not self.token_merge:
            return self.norm(self.blocks(x, grid)), None
        schedule = merge_schedule(self.token_merge, len(self.blocks), x.shape[1] - self.num_prefix_tokens)
        x, sizes = merge_through(self.blocks, x, schedule, self.num_prefix_tokens)
        return self.norm(x), sizes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens ``(B, N, D)`` after the final norm: the class token first when
        there is one, then the register tokens, then the patches row by row (with token merging,
        fewer: :mod:`vitflow.models.token_merging` gives their order)."""
        return self.forward_tokens(x)[0]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False, sizes: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """Tokens ``(B, N, D)`` -> logits ``(B, num_classes)`` (or pooled ``(B, D)`` if ``pre_logits``):
        pool (:func:`~vitflow.models.pool.pool_tokens`, ``sizes`` from token merging) -> ``fc_norm``
        -> dropout -> ``head``."""
        x = pool_tokens(x, self.global_pool, self.num_prefix_tokens, self.attn_pool, sizes)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, sizes = self.forward_tokens(x)
        return self.forward_head(x, sizes=sizes)

    def attention_maps(self, x: torch.Tensor, layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per-layer attention probabilities, computed explicitly whatever the backend.

        Args:
            x: images ``(B, C, H, W)``.
            layers: block indices (negative counts from the end); ``None`` = all blocks.
        Returns:
            One float32 ``(B, H, N, N)`` tensor per requested layer, in the order given; row
            ``i`` is query token ``i`` in :meth:`forward_features`' order: the class token (token 0
            when present), then the ``num_reg_tokens`` register tokens, then the patches. Register
            tokens are attended to like any key, so the patch columns of a row sum to less than one
            where registers take attention (DINOv2-reg: they absorb the high-norm "artefact"
            attention). A ``map`` head's own attention is :meth:`AttentionPoolLatent.probs
            <vitflow.models.pool.AttentionPoolLatent.probs>`. The forward stops after the deepest
            requested block. Runs under the caller's grad mode.
        Raises:
            IndexError: a layer index out of range.
        """
        x, grid = self._embed(x)
        return self.blocks.attention_maps(self.norm_pre(x), grid, layers)
