"""DeiT's distilled ViT (Touvron et al. 2021, "Training data-efficient image transformers &
distillation through attention", sec. 4): a second learned token, the *distillation token*,
travels through the blocks beside the class token and feeds its own head, trained to match the
teacher while the class head learns the labels.

Parameter names follow timm's ``VisionTransformerDistilled`` (``dist_token``, ``head_dist``;
``pos_embed`` covers both tokens), so timm DeiT-distilled checkpoints of the same
configuration load as they are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vitflow.models.kernels.matmul import Linear
from vitflow.models.vit.model import VisionTransformer


class VisionTransformerDistilled(VisionTransformer):
    """A :class:`VisionTransformer` with a distillation token and head.

    Tokens: ``[cls, dist, patches...]``, so ``num_prefix_tokens = 2``; ``global_pool`` must be
    ``"token"``.

    ``forward(x)``: ``(B, C, H, W)`` -> logits ``(B, num_classes)``: the mean of the two heads
    (DeiT's inference rule). While ``distilled_training`` is set and the module is in training
    mode it returns the pair ``(class-head logits, distillation-head logits)`` instead, for
    :class:`vitflow.training.objectives.distill.DistillationLoss`.

    Raises:
        ValueError: ``global_pool`` other than ``"token"`` (plus :class:`VisionTransformer`'s).
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("global_pool", "token") != "token":
            raise ValueError("a distilled ViT pools its class and distillation tokens: global_pool must be 'token'")
        super().__init__(*args, **kwargs)
        self.num_prefix_tokens = 2
        self.distilled_training = False
        self.dist_token = nn.Parameter(torch.zeros(1, 1, self.embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size**2 + 2, self.embed_dim))
        self.head_dist = (Linear(self.embed_dim, self.num_classes, gemm=self.cpu_bf16_matmul) if self.num_classes > 0
                          else nn.Identity())
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.dist_token, std=0.02)
        if self.num_classes > 0:
            nn.init.trunc_normal_(self.head_dist.weight, std=0.02)
            nn.init.zeros_(self.head_dist.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"dist_token"}

    def _pos_embed(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        x = torch.cat([self.dist_token.expand(x.shape[0], -1, -1), x], dim=1)
        return super()._pos_embed(x, grid_hw)  # prepends the class token, adds pos_embed

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False, sizes: torch.Tensor | None = None):
        """Tokens ``(B, N, D)`` -> averaged logits ``(B, num_classes)``, or the pair of head
        logits in distilled training (see the class docstring). ``pre_logits``: the class token
        ``(B, D)``. ``sizes`` (token merging) is unused: both heads read prefix tokens, never merged."""
        cls, dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
        if pre_logits:
            return cls
        cls, dist = self.head(cls), self.head_dist(dist)
        if self.distilled_training and self.training:
            return cls, dist
        return (cls + dist) / 2

    def reset_classifier(self, num_classes: int) -> None:
        super().reset_classifier(num_classes)
        self.head_dist = Linear(self.embed_dim, num_classes, gemm=self.cpu_bf16_matmul) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.trunc_normal_(self.head_dist.weight, std=0.02)
            nn.init.zeros_(self.head_dist.bias)
