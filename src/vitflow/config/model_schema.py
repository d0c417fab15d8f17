"""The ``model`` section: the keys every model family takes (:class:`ModelConfig`) and one subclass
per kind of model with the keys of its own, each with its own ``validate()``.

Which class a run's ``model`` section is, is the model layer's knowledge (``ModelFamily.config``,
:func:`vitflow.models.config_class`); :func:`vitflow.config.build_config` asks it for the final
``model.name`` before it applies any key, so a key of another family fails with one line naming
the family and its keys. The field names are the arguments of :func:`vitflow.create_model`, so a
checkpoint's ``model_args`` are this section as it is (plus the class count found in the data).

A new family with keys of its own adds one subclass here (a ``label`` for messages, its fields
with their comments, which the configuration reference shows, and a ``validate()`` calling the
parent's) and names it as ``config=`` in its ``ModelFamily``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from vitflow.config.checks import check as _check


@dataclass
class ModelConfig:
    """Which model to build (see ``vitflow.list_models()``) and its per-run options: the keys every
    family takes. Each family adds its own (the sections below); a key of another family is refused."""

    label: ClassVar[str] = "these"  # the models a class configures, in messages ("Swin", "ViT / DeiT")

    name: str = "vit_digits_patch2_8"  # a variant of `vitflow models`; auto = the one model.pretrained's config names
    # weights: a file (timm, Hugging Face, OpenCLIP or big_vision names), a hub snapshot folder or
    # hf-hub:ORG/NAME[@rev]; head/pos_embed adapted; its preprocessing (mean, std, size, crop, interpolation) used
    # unless set
    pretrained: str | None = None
    img_size: int | None = None  # input resolution in pixels; None = the variant's own
    num_classes: int | None = None  # None = number of classes found in the data
    embed_dim: int | None = None  # token width (Swin: the first stage's); None = the variant's
    mlp_ratio: float | None = None  # MLP hidden width / embed_dim; None = the variant's
    patch_size: int | None = None  # patch side in pixels; None = the variant's
    global_pool: Literal["token", "avg", "map"] | None = None  # None = the variant's; map: attention pooling
    # the attention kernel (each family takes some: see its section); auto times the exact ones
    attention: Literal["sdpa", "math", "blockwise", "local", "axial", "linformer", "performer", "fused",
                       "auto"] = "sdpa"
    drop_rate: float = 0.0  # dropout on activations (after positions, in the MLP, before the head)
    drop_path_rate: float = 0.0  # stochastic depth of the last block, rising linearly from 0
    # GEMM of the linear layers under bf16 autocast on a CPU: auto (timed per shape) | bf16 (oneDNN's) | fp32
    cpu_bf16_matmul: Literal["auto", "bf16", "fp32"] = "auto"
    grad_checkpointing: str = "none"  # none | all | auto | every:K | block indices "0,3,6"
    grad_checkpointing_budget: str | None = None  # activation memory for auto, e.g. 2GiB

    def validate(self) -> None:
        for key in ("img_size", "embed_dim", "mlp_ratio", "patch_size", "num_classes"):
            _check(getattr(self, key) is None or getattr(self, key) > 0, f"model.{key}", getattr(self, key), "> 0")
        _check(0 <= self.drop_rate < 1, "model.drop_rate", self.drop_rate, "in [0, 1)")
        _check(0 <= self.drop_path_rate < 1, "model.drop_path_rate", self.drop_path_rate, "in [0, 1)")


@dataclass
class ViTLayoutConfig(ModelConfig):
    """Models in timm's ``VisionTransformer`` layout: DeiT III, DINOv2, CLIP and SigLIP towers (and,
    with ``model.distilled``, the plain ViT / DeiT below)."""

    label: ClassVar[str] = "DeiT III / DINOv2 / CLIP / SigLIP"

    depth: int | None = None  # blocks; None = the variant's
    num_heads: int | None = None  # attention heads; None = the variant's
    # sdpa | math | blockwise | local | axial | linformer | performer | auto (times the exact ones)
    attention: Literal["sdpa", "math", "blockwise", "local", "axial", "linformer", "performer", "auto"] = "sdpa"
    attn_block_size: int = 128  # blockwise: keys per block (memory ~ N * block)
    attn_window: int = 3  # local: window radius in patches
    linformer_k: int | None = None  # linformer: projected length; None = tokens // 4
    performer_features: int | None = None  # performer: random features; None = d ln d
    pos_embed: Literal["learned", "sincos2d", "relative"] = "learned"  # learned | 2-D sin-cos | relative bias
    layer_scale_init: float | None = None  # LayerScale initial value (e.g. 1e-5); None = off
    patch_drop_rate: float = 0.0  # PatchDropout: fraction of patch tokens dropped per image in training
    weight_init: Literal["timm", "jax"] = "timm"  # jax: Xavier linears, zero head (big_vision / timm "jax")
    # token merging (ToMe, Bolya et al. 2023): patch tokens merged per block (or one count per block); 0 = off
    token_merge: int | tuple[int, ...] = 0

    def validate(self) -> None:
        super().validate()
        merge = self.token_merge if isinstance(self.token_merge, tuple) else (self.token_merge,)
        _check(all(v >= 0 for v in merge), "model.token_merge", self.token_merge, ">= 0 (each)")
        for key in ("depth", "num_heads"):
            _check(getattr(self, key) is None or getattr(self, key) > 0, f"model.{key}", getattr(self, key), "> 0")
        _check(0 <= self.patch_drop_rate < 1, "model.patch_drop_rate", self.patch_drop_rate, "in [0, 1)")
        _check(self.attn_block_size >= 1, "model.attn_block_size", self.attn_block_size, ">= 1")
        _check(self.attn_window >= 0, "model.attn_window", self.attn_window, ">= 0")
        _check(self.linformer_k is None or self.linformer_k >= 1, "model.linformer_k", self.linformer_k, ">= 1")
        _check(self.performer_features is None or self.performer_features >= 1, "model.performer_features",
               self.performer_features, ">= 1")
        _check(self.layer_scale_init is None or self.layer_scale_init > 0, "model.layer_scale_init",
               self.layer_scale_init, "> 0")
        _check(not (self.pos_embed == "relative" and self.attention in ("linformer", "performer")),
               "model.attention", self.attention, "one that adds a logit bias with model.pos_embed=relative")


@dataclass
class ViTConfig(ViTLayoutConfig):
    """The plain ViT (Dosovitskiy et al. 2021) and DeiT (Touvron et al. 2021): the layout's keys plus
    DeiT's distillation token. The default family (``vit_digits_patch2_8``)."""

    label: ClassVar[str] = "ViT / DeiT"

    distilled: bool = False  # DeiT distillation token + head_dist (needs global_pool=token)

    def validate(self) -> None:
        super().validate()
        _check(not self.distilled or self.global_pool in (None, "token"), "model.global_pool", self.global_pool,
               "token (or unset) with model.distilled=true")


@dataclass
class EvaConfig(ModelConfig):
    """EVA-02, DINOv3 and BEiT (timm's ``Eva`` / ``Beit`` layout): their position encoding (RoPE,
    per-block relative bias) is the architecture's, so they take no ``pos_embed``; their attention
    runs on the exact kernels only (RoPE and the relative bias need every token)."""

    label: ClassVar[str] = "EVA-02 / DINOv3 / BEiT"

    depth: int | None = None  # blocks; None = the variant's
    num_heads: int | None = None  # attention heads; None = the variant's
    global_pool: Literal["token", "avg"] | None = None  # None = the variant's; token: the class token through norm
    attention: Literal["sdpa", "math", "blockwise", "auto"] = "sdpa"  # exact kernels; auto times them
    attn_block_size: int = 128  # blockwise: keys per block (memory ~ N * block)
    layer_scale_init: float | None = None  # LayerScale initial value; None = the variant's (or off)

    def validate(self) -> None:
        super().validate()
        for key in ("depth", "num_heads"):
            _check(getattr(self, key) is None or getattr(self, key) > 0, f"model.{key}", getattr(self, key), "> 0")
        _check(self.attn_block_size >= 1, "model.attn_block_size", self.attn_block_size, ">= 1")
        _check(self.layer_scale_init is None or self.layer_scale_init > 0, "model.layer_scale_init",
               self.layer_scale_init, "> 0")


@dataclass
class SwinConfig(ModelConfig):
    """Swin and Swin V2 (Liu et al. 2021, 2022): stages of blocks attending within shifted windows;
    depths and heads are per stage, the position encoding is the per-window relative bias."""

    label: ClassVar[str] = "Swin"

    depths: tuple[int, ...] | None = None  # blocks per stage, e.g. 2,2,6,2; None = the variant's
    num_heads: tuple[int, ...] | None = None  # attention heads per stage, e.g. 3,6,12,24; None = the variant's
    window_size: int | None = None  # window side in patches (shrinks to a smaller stage grid); None = the variant's
    global_pool: Literal["avg"] | None = None  # the mean over the last stage's grid (timm's)
    # window attention: sdpa | math | fused (vitflow's C++ CPU kernel) | auto (times them)
    attention: Literal["sdpa", "math", "fused", "auto"] = "sdpa"

    def validate(self) -> None:
        super().validate()
        _check(self.window_size is None or self.window_size >= 1, "model.window_size", self.window_size, ">= 1")
        for key in ("depths", "num_heads"):
            value = getattr(self, key)
            _check(value is None or (len(value) > 0 and min(value) > 0), f"model.{key}", value,
                   "one positive number per stage")
        _check(self.depths is None or self.num_heads is None or len(self.depths) == len(self.num_heads),
               "model.num_heads", self.num_heads, f"one number per stage of model.depths={self.depths}")



@dataclass
class MViTConfig(ModelConfig):
    """MViTv2 (Li et al. 2022): multiscale stages with pooling attention; depths are per stage,
    ``embed_dim`` / ``num_heads`` the first stage's (doubled per stage, timm's rule), the position
    encoding is the decomposed relative embedding in each block."""

    label: ClassVar[str] = "MViTv2"

    depths: tuple[int, ...] | None = None  # blocks per stage, e.g. 1,2,5,2; None = the variant's
    num_heads: int | None = None  # the first stage's attention heads (doubled per stage); None = the variant's
    # avg: the mean of the last stage's grid tokens; token: the class token (the *_cls variants); None = the variant's
    global_pool: Literal["avg", "token"] | None = None
    # pooling attention: sdpa | math (vitflow's, with a hand-written backward) | auto (times them)
    attention: Literal["sdpa", "math", "auto"] = "sdpa"

    def validate(self) -> None:
        super().validate()
        _check(self.num_heads is None or self.num_heads > 0, "model.num_heads", self.num_heads, "> 0")
        _check(self.depths is None or (len(self.depths) > 0 and min(self.depths) > 0), "model.depths", self.depths,
               "one positive number per stage")

def model_config_classes() -> list[type[ModelConfig]]:
    """:class:`ModelConfig` and every subclass (the families' sections), each parent before its
    children (depth first, in definition order)."""
    def walk(cls: type[ModelConfig]) -> list[type[ModelConfig]]:
        return [cls] + [c for sub in cls.__subclasses__() for c in walk(sub)]

    return list(dict.fromkeys(walk(ModelConfig)))
