"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}.norm1``, ``.attn.qkv``, ``.attn.proj``, ``.ls1.gamma``, ``.norm2``,
``.mlp.fc1``, ``.mlp.fc2``, ``.ls2.gamma``, ``norm`` / ``fc_norm``, ``head``) so that a timm
state_dict of the same configuration loads with ``strict=True``. Attention math lives in
:mod:`vitflow.models.attention`, position encodings in :mod:`vitflow.models.position`, the
checkpointing plan in :mod:`vitflow.models.checkpointing`.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from vitflow.models.attention import AttentionContext, AutoKernel, attention_probs, make_kernel, split_heads
from vitflow.models.attention import auto
from vitflow.models.checkpointing import CheckpointPlan, saved_activation_bytes
from vitflow.models.matmul import check_mode, linear, linear_residual
from vitflow.models.timing import tracing
from vitflow.models.position import POS_EMBEDS, RelativePositionBias, resample_pos_embed, sincos_2d

LN_EPS = 1e-6  # the ViT / timm LayerNorm epsilon

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = ()

__all__ = ["Attention", "Block", "DropPath", "LayerScale", "Mlp", "PatchEmbed", "VisionTransformer",
           "resample_pos_embed"]


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
    """Multi-head self-attention with a fused qkv projection and a pluggable backend.

    Input and output ``(B, N, D)``. ``backend`` names a kernel of
    :mod:`vitflow.models.attention` (built by :func:`~vitflow.models.attention.make_kernel` with
    ``backend_options``); ``rel_pos`` adds a per-head relative position bias to the logits.
    ``head_dim`` defaults to ``dim // num_heads``; giving it explicitly allows
    ``num_heads * head_dim != dim`` (a head-pruned block, see :mod:`vitflow.infer.prune`): qkv is
    then ``D -> 3 * H * head_dim`` and proj ``H * head_dim -> D``.
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
        self.qkv = nn.Linear(dim, inner * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(inner, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rel_pos = RelativePositionBias(num_heads, self.grid, num_prefix_tokens) if rel_pos else None
        self.matmul = "auto"  # bf16 CPU GEMM choice of qkv / proj (vitflow.models.matmul)
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
        add done by the output projection's GEMM where possible (:func:`linear_residual`)."""
        h = self.kernel(linear(self.qkv, x, self.matmul), self.num_heads, self.context(grid))
        return _project(self.proj, h, self.proj_drop, residual, self.matmul)

    def probs(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        """Attention probabilities ``(B, H, N, N)`` float32 computed explicitly (the math path,
        with the relative bias and the sparse pattern if any) whatever the backend.

        For ``linformer`` and ``performer`` this is the exact softmax attention of the same
        queries and keys, which those backends approximate."""
        ctx = self.context(grid)
        q, k, _ = split_heads(linear(self.qkv, x, self.matmul), self.num_heads)
        mask = self.kernel.mask(ctx.grid, ctx.num_prefix_tokens, x.device)
        bias = None if ctx.bias is None else ctx.bias.float()
        return attention_probs(q.float(), k.float(), bias, mask)


class Mlp(nn.Module):
    """Two-layer GELU MLP: ``fc1 -> GELU -> dropout -> fc2 -> dropout``; ``(B, N, D) -> (B, N, D)``.

    Without autograd (inference) the GELU runs in place on fc1's output, which saves the
    largest activation allocation of the block."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)
        self.matmul = "auto"  # bf16 CPU GEMM choice (vitflow.models.matmul)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N, D) -> (B, N, D)``; with ``residual``, ``residual + mlp(x)`` (as in :class:`Attention`)."""
        h = linear(self.fc1, x, self.matmul)
        h = torch.ops.aten.gelu_(h) if not torch.is_grad_enabled() else self.act(h)
        return _project(self.fc2, self.drop1(h), self.drop2, residual, self.matmul)


def _project(layer: nn.Linear, h: torch.Tensor, drop: nn.Dropout, residual: torch.Tensor | None,
             mode: str) -> torch.Tensor:
    """``drop(layer(h))``, plus ``residual`` if given: fused into the GEMM when the dropout is inactive."""
    if residual is None:
        return drop(linear(layer, h, mode))
    if drop.training and drop.p > 0:
        return residual + drop(linear(layer, h, mode))
    return linear_residual(residual, layer, h, mode)


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


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch, initialised to a small constant
    (CaiT, Touvron et al. 2021). ``(..., D) -> (..., D)``; parameter ``gamma (D,)``."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer encoder block: ``x + ls1(attn(norm1(x)))`` then ``x + ls2(mlp(norm2(x)))``
    (each branch through stochastic depth). ``mlp_hidden`` overrides ``int(dim * mlp_ratio)`` and
    ``attn_kwargs`` may carry ``head_dim`` (pruned blocks, :mod:`vitflow.infer.prune`)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0, attention: str = "sdpa",
                 layer_scale_init: float | None = None, mlp_hidden: int | None = None, **attn_kwargs):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, attention, **attn_kwargs)
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, mlp_hidden or int(dim * mlp_ratio), drop)
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
        if self._plain(self.attn, Attention, self.ls1, self.drop_path1):  # the add goes into proj's GEMM
            x = self.attn(self.norm1(x), grid, residual=x)
        else:
            x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), grid)))
        if self._plain(self.mlp, Mlp, self.ls2, self.drop_path2):
            return self.mlp(self.norm2(x), residual=x)
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    @staticmethod
    def _plain(branch: nn.Module, kind: type, layer_scale: nn.Module, drop_path: nn.Module) -> bool:
        """The branch is vitflow's own module (export swaps in others) and adds its output unscaled:
        no LayerScale, stochastic depth off or inactive."""
        return (isinstance(branch, kind) and isinstance(layer_scale, nn.Identity)
                and (isinstance(drop_path, nn.Identity) or not drop_path.training))


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
        attention: attention backend (:data:`vitflow.models.attention.BACKENDS`).
        pos_embed: ``"learned"`` (parameter ``pos_embed``, resampled bicubically for another
            grid), ``"sincos2d"`` (fixed) or ``"relative"`` (per-head bias in every block, no
            absolute embedding); see :mod:`vitflow.models.position`.
        layer_scale_init: LayerScale initial value (e.g. 1e-5); ``None`` = no LayerScale.
        attn_block_size: ``blockwise`` key-block size.
        attn_window: ``local`` window radius in patches.
        linformer_k: Linformer projected length (default tokens // 4).
        performer_features: Performer random features (default ``round(d ln d)``).
        block_heads, block_mlp_hidden: per-block head counts and MLP hidden sizes (length
            ``depth``) for pruned models (:mod:`vitflow.infer.prune`); ``None`` gives every block
            ``num_heads`` heads of ``embed_dim // num_heads`` and ``int(embed_dim * mlp_ratio)``
            hidden units (the timm layout). Pruned blocks keep the unpruned head dimension.
        patch_drop_rate: fraction of patch tokens dropped per sample in training (:class:`PatchDropout`;
            needs an attention that takes any token set: no ``relative`` position bias, no sparse pattern).
        weight_init: ``"timm"`` (timm's default) or ``"jax"`` (the original JAX / big_vision scheme,
            timm's ``weight_init="jax"``: zero head; see :meth:`init_weights`).
        cpu_bf16_matmul: under bf16 autocast on the CPU, the GEMM of the linear layers:
            ``bf16`` (oneDNN's), ``fp32`` (the same bf16-rounded operands through the fp32 GEMM) or
            ``auto`` (timed per shape); see :mod:`vitflow.models.matmul`.

    ``forward(x)``: ``(B, in_chans, H, W)`` float -> logits ``(B, num_classes)``; H and W may
    differ from ``img_size`` (multiples of the patch size): the position encoding follows.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, global_pool: Literal["token", "avg"] = "token", drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0, attention: str = "sdpa",
                 pos_embed: str = "learned", layer_scale_init: float | None = None, attn_block_size: int = 128,
                 attn_window: int = 3, linformer_k: int | None = None, performer_features: int | None = None,
                 block_heads: list[int] | None = None, block_mlp_hidden: list[int] | None = None,
                 patch_drop_rate: float = 0.0, weight_init: Literal["timm", "jax"] = "timm",
                 cpu_bf16_matmul: Literal["auto", "bf16", "fp32"] = "auto"):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        if pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {', '.join(POS_EMBEDS)}, got {pos_embed!r}")
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.num_classes, self.embed_dim, self.global_pool = num_classes, embed_dim, global_pool
        self.grid_size = img_size // patch_size
        self.num_prefix_tokens = 1 if global_pool == "token" else 0
        self.pos_embed_type = pos_embed
        self.attention_options = dict(block_size=attn_block_size, window=attn_window, linformer_k=linformer_k,
                                      performer_features=performer_features)
        self.checkpoint_plan = CheckpointPlan()
        self._tuned_inputs: set[tuple] = set()  # token-input keys whose blocks' ``auto`` attention has chosen

        grid = (self.grid_size, self.grid_size)
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if self.num_prefix_tokens else None
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size**2 + self.num_prefix_tokens, embed_dim))
        elif pos_embed == "sincos2d":
            self.register_buffer("pos_embed", sincos_2d(grid, embed_dim, self.num_prefix_tokens), persistent=False)
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(drop_rate)
        self.patch_drop = PatchDropout(patch_drop_rate)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        for name, per_block in (("block_heads", block_heads), ("block_mlp_hidden", block_mlp_hidden)):
            if per_block is not None and (len(per_block) != depth or min(per_block) < 1):
                raise ValueError(f"{name} needs {depth} positive entries (one per block), got {list(per_block)}")
        head_dim = embed_dim // num_heads if block_heads is not None else None
        self.blocks = nn.Sequential(*[
            Block(embed_dim, block_heads[i] if block_heads else num_heads, mlp_ratio, qkv_bias, drop_rate,
                  attn_drop_rate, dpr[i], attention, layer_scale_init,
                  block_mlp_hidden[i] if block_mlp_hidden else None, head_dim=head_dim, grid=grid,
                  num_prefix_tokens=self.num_prefix_tokens, rel_pos=pos_embed == "relative",
                  backend_options=self.attention_options)
            for i in range(depth)
        ])
        use_fc_norm = global_pool == "avg"
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(embed_dim, eps=LN_EPS)
        self.fc_norm = nn.LayerNorm(embed_dim, eps=LN_EPS) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.set_cpu_bf16_matmul(cpu_bf16_matmul)
        self.init_weights(weight_init)

    def init_weights(self, mode: Literal["timm", "jax"] = "timm") -> None:
        """Initialise every parameter.

        ``timm`` (timm's default): truncated normal (std 0.02) for linears, zero biases.
        ``jax`` (the original ViT / big_vision code, timm's ``weight_init="jax"``): Xavier-uniform
        linears, MLP biases normal (std 1e-6), other biases zero, a zero head (every class starts
        equally likely), LeCun-normal patch embedding. Both: position embedding truncated normal
        (std 0.02), class token normal (std 1e-6), unit LayerNorms.

        Raises:
            ValueError: unknown ``mode``.
        """
        if mode not in ("timm", "jax"):
            raise ValueError(f"weight_init must be 'timm' or 'jax', got {mode!r}")
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
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
            nn.init.zeros_(self.patch_embed.proj.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names excluded from weight decay beside all 1-D parameters (norms, biases):
        the position embedding, the class token and the relative position bias tables."""
        names = {"pos_embed", "cls_token"}
        return names | {n for n, _ in self.named_parameters() if n.endswith("relative_position_bias_table")}

    @property
    def attention_backend(self) -> str:
        return self.blocks[0].attn.backend if len(self.blocks) else "sdpa"

    def set_attention_backend(self, backend: str, **options) -> None:
        """Switch every block's attention backend (weights unchanged). ``options`` override the
        model's ``block_size``, ``window``, ``linformer_k``, ``performer_features``.

        Raises:
            ValueError: unknown backend, bad option, or a backend that cannot take the
            relative position bias.
        """
        opts = {**self.attention_options, **options}
        for blk in self.blocks:
            blk.attn.set_backend(backend, **opts)
        self.attention_options = opts

    def set_cpu_bf16_matmul(self, mode: str) -> None:
        """Choose the GEMM of every linear layer under bf16 CPU autocast: ``auto``, ``bf16`` or
        ``fp32`` (:mod:`vitflow.models.matmul`). Raises ValueError for another mode."""
        self.cpu_bf16_matmul = check_mode(mode)
        for m in self.modules():
            if isinstance(m, (Attention, Mlp)):
                m.matmul = mode

    def set_grad_checkpointing(self, enable: bool | str | Sequence[int] = True,
                               memory_budget: int | str | None = None) -> None:
        """Recompute activations of some blocks in the backward pass (torch.utils.checkpoint,
        non-reentrant), trading compute for activation memory.

        Args:
            enable: ``True`` / ``"all"`` (every block), ``False`` / ``"none"``, a list of block
                indices (or ``"0,3,6"``), ``"every:K"`` (blocks 0, K, 2K, ...), or ``"auto"``:
                the fewest blocks that keep the activations within ``memory_budget``.
            memory_budget: bytes or a size like ``"2GiB"`` (``auto`` only).
        Raises:
            ValueError: an unreadable spec or ``auto`` without a budget (see
            :class:`~vitflow.models.checkpointing.CheckpointPlan`).
        """
        self.checkpoint_plan = CheckpointPlan.parse(enable, memory_budget)

    @property
    def grad_checkpointing(self) -> bool:
        return self.checkpoint_plan.enabled

    def _pos_embed(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.pos_embed_type in ("learned", "sincos2d"):  # "relative" biases the attention instead
            pos = self.pos_embed
            if grid_hw != (self.grid_size, self.grid_size):  # another grid: resample / recompute
                pos = (resample_pos_embed(pos, grid_hw, self.num_prefix_tokens) if self.pos_embed_type == "learned"
                       else sincos_2d(grid_hw, self.embed_dim, self.num_prefix_tokens, device=x.device))
            x = x + pos
        return self.pos_drop(x)

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)
        return self._pos_embed(self.patch_embed(x), grid), grid

    def _checkpointed_blocks(self, x: torch.Tensor, grid: tuple[int, int]) -> frozenset[int]:
        if not self.checkpoint_plan.enabled or not torch.is_grad_enabled():
            return frozenset()

        def measure() -> tuple[int, int]:
            devices = [x.device] if x.device.type == "cuda" else []
            # with attention=auto, measured on the explicit path (the exact backend that keeps the
            # most: the N x N probabilities), before the backend is chosen: a conservative plan
            with torch.random.fork_rng(devices=devices), auto.forced("math"):
                per_block = saved_activation_bytes(lambda: self.blocks[0](x.detach().requires_grad_(), grid),
                                                   exclude=list(self.parameters()))
            return per_block, x.numel() * x.element_size()

        key = (tuple(x.shape), x.dtype, str(x.device), torch.is_autocast_enabled(x.device.type))
        return self.checkpoint_plan.blocks(len(self.blocks), measure, key)

    def _tune_attention(self, x: torch.Tensor, grid: tuple[int, int], ckpt: frozenset[int]) -> None:
        """With ``attention=auto``, once per token-input key: choose the backend by timing the
        whole block stack on ``x`` ``(B, N, D)`` with each candidate in every block
        (:func:`~vitflow.models.attention.auto.tune`): forward, plus the backward to ``x`` and the
        blocks' parameters when gradients are on (``torch.autograd.grad``: no ``.grad`` is
        written), with the same blocks checkpointed as the real step. Not for FSDP-sharded blocks
        (their backward hooks would write ``.grad``): there each kernel times itself alone."""
        if tracing():  # checked first: reading x's shape there would pin a dynamic batch size
            return
        dev = x.device.type
        tkey = (tuple(x.shape), x.dtype, str(x.device), torch.is_grad_enabled(), self.training,
                torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev))  # torch >= 2.4
        if tkey in self._tuned_inputs:
            return
        self._tuned_inputs.add(tkey)
        kernels = [(blk, getattr(blk.attn, "kernel", None)) for blk in self.blocks]  # export swaps in kernel-less ones
        autos = [(blk, k) for blk, k in kernels if isinstance(k, AutoKernel)]
        params = [p for p in self.blocks.parameters() if p.requires_grad]
        if not autos or any(isinstance(p, _DTensor) for p in params):
            return  # FSDP-sharded blocks: their backward hooks write .grad; the kernels time themselves alone
        keys = {k.key(blk.attn.qkv(blk.norm1(x)), blk.attn.num_heads, blk.attn.context(grid)) for blk, k in autos}
        keys = [k for k in keys if not auto.decided(k)]
        if not keys:
            return
        backward = any(k[-1] for k in keys)

        def run() -> None:
            xi = x.detach().requires_grad_() if backward else x
            out = self._run_blocks(xi, grid, ckpt)
            if backward:
                torch.autograd.grad(out, [xi, *params], torch.ones_like(out), allow_unused=True)

        auto.tune(keys, list(autos[0][1].candidates), run, x.device)

    def _run_blocks(self, x: torch.Tensor, grid: tuple[int, int], ckpt: frozenset[int]) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            x = checkpoint(blk, x, grid, use_reentrant=False) if i in ckpt else blk(x, grid)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> tokens ``(B, N, D)`` after the final norm (class token first when
        ``global_pool == "token"``)."""
        x, grid = self._embed(x)
        x = self.patch_drop(x, self.num_prefix_tokens)
        ckpt = self._checkpointed_blocks(x, grid)
        self._tune_attention(x, grid, ckpt)
        return self.norm(self._run_blocks(x, grid, ckpt))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens ``(B, N, D)`` -> logits ``(B, num_classes)`` (or pooled ``(B, D)`` if ``pre_logits``)."""
        x = x[:, 0] if self.global_pool == "token" else x.mean(dim=1)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else linear(self.head, x, self.cpu_bf16_matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def attention_maps(self, x: torch.Tensor, layers: int | Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per-layer attention probabilities, computed explicitly whatever the backend.

        Args:
            x: images ``(B, C, H, W)``.
            layers: block indices (negative counts from the end); ``None`` = all blocks.
        Returns:
            One float32 ``(B, H, N, N)`` tensor per requested layer, in the order given; row
            ``i`` is query token ``i`` (the class token is token 0 when present). The forward
            stops after the deepest requested block. Runs under the caller's grad mode.
        Raises:
            IndexError: a layer index out of range.
        """
        depth = len(self.blocks)
        wanted = list(range(depth)) if layers is None else [layers] if isinstance(layers, int) else list(layers)
        for i in wanted:
            if not -depth <= i < depth:
                raise IndexError(f"layer {i} out of range for a {depth}-block model")
        wanted = [i % depth for i in wanted]
        maps: dict[int, torch.Tensor] = {}
        x, grid = self._embed(x)
        for i, blk in enumerate(self.blocks[:max(wanted) + 1]):
            if i in wanted:
                maps[i] = blk.attn.probs(blk.norm1(x), grid)
            x = blk(x, grid)
        return [maps[i] for i in wanted]

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised ``Linear(embed_dim, num_classes)``."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
