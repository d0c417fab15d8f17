"""What every vitflow encoder offers beside its forward, in one place: weight-decay exclusions,
the attention backend and bf16 GEMM switches, the gradient-checkpointing plan and a fresh head.
:class:`~vitflow.models.vit.model.VisionTransformer` (ViT, DeiT, DeiT III, DINOv2, CLIP, SigLIP) and
:class:`~vitflow.models.eva.model.Eva` (BEiT, EVA-02, DINOv3) both take it; it reads their ``blocks``
(a :class:`~vitflow.models.block.Blocks` whose blocks have ``attn.set_backend``),
``attention_options``, ``embed_dim``, ``num_classes`` and ``cpu_bf16_matmul``.
:class:`StageControls` is the same for the hierarchical families (Swin, MViTv2), whose ``blocks``
is a plain list over their stages."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from vitflow.models.grad_checkpointing import CheckpointPlan
from vitflow.models.kernels.matmul import set_gemm_mode
from vitflow.models.layers import classifier_head


class EncoderControls:
    """Model-level controls shared by vitflow's encoders (mixed in before ``nn.Module``)."""

    blocks: nn.Sequential
    attention_options: dict
    embed_dim: int
    num_classes: int
    cpu_bf16_matmul: str

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names excluded from weight decay beside all 1-D parameters (norms, biases):
        the position embedding, the class and register tokens and the relative position bias tables."""
        names = {"pos_embed", "cls_token", "reg_token"}
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
        ``fp32`` (:mod:`vitflow.models.kernels.matmul`). Raises ValueError for another mode."""
        self.cpu_bf16_matmul = set_gemm_mode(self, mode)

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
            ValueError: an unreadable spec, block indices outside the model, or ``auto`` without
            a budget (see :class:`~vitflow.models.grad_checkpointing.CheckpointPlan`).
        """
        self.blocks.set_plan(CheckpointPlan.parse(enable, memory_budget))

    @property
    def checkpoint_plan(self) -> CheckpointPlan:
        return self.blocks.checkpoint_plan

    @property
    def grad_checkpointing(self) -> bool:
        return self.checkpoint_plan.enabled


    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised ``Linear(embed_dim, num_classes)``."""
        self.num_classes = num_classes
        self.head = classifier_head(self.embed_dim, num_classes, self.cpu_bf16_matmul)


class StageControls:
    """Model-level controls of the hierarchical encoders (Swin, MViTv2; mixed in before
    ``nn.Module``): ``blocks`` is a plain list of every block over all stages (block indices count
    over it), the head is ``head.fc`` on ``num_features``; an ``auto`` checkpoint plan is resolved
    per input shape by the family's own planner (which calls :meth:`set_checkpointed`)."""

    blocks: list
    num_features: int
    num_classes: int
    cpu_bf16_matmul: str
    checkpoint_plan: CheckpointPlan

    @property
    def attention_backend(self) -> str:
        return self.blocks[0].attn.backend

    def set_attention_backend(self, backend: str, **options) -> None:
        """Switch every block's attention kernel (the family's backends); weights unchanged.
        Raises ValueError for a backend the family does not run."""
        for blk in self.blocks:
            blk.attn.set_backend(backend, **options)

    def set_cpu_bf16_matmul(self, mode: str) -> None:
        """The GEMM of every vitflow linear layer under bf16 CPU autocast (``auto``, ``bf16``,
        ``fp32``; :mod:`vitflow.models.kernels.matmul`). Raises ValueError for another mode."""
        self.cpu_bf16_matmul = set_gemm_mode(self, mode)

    def set_grad_checkpointing(self, enable: bool | str | Sequence[int] = True,
                               memory_budget: int | str | None = None) -> None:
        """Recompute some blocks in the backward pass; block indices count over all stages in
        order (``"all"``, ``"none"``, ``"every:K"``, ``"0,3,6"``, or ``"auto"`` with
        ``memory_budget``: planned per input shape by the family).

        Raises:
            ValueError: an unreadable spec, indices outside the model, ``auto`` without a budget.
        """
        plan = CheckpointPlan.parse(enable, memory_budget)
        self.set_checkpointed(plan.blocks(len(self.blocks)) if plan.mode != "auto" else frozenset())
        self.checkpoint_plan = plan

    def set_checkpointed(self, indices: frozenset[int]) -> None:
        """Checkpoint exactly the blocks ``indices`` (over all stages)."""
        for i, blk in enumerate(self.blocks):
            blk.grad_checkpointing = i in indices

    @property
    def grad_checkpointing(self) -> bool:
        return self.checkpoint_plan.enabled

    def reset_classifier(self, num_classes: int) -> None:
        """A fresh ``head.fc`` for ``num_classes`` (0: pooled features)."""
        self.num_classes = num_classes
        self.head.fc = classifier_head(self.num_features, num_classes, self.cpu_bf16_matmul)
