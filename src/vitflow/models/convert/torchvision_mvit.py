"""torchvision's MViTv2 (``torchvision.models.video.mvit_v2_s``) -> timm's (= vitflow's) MViTv2 names.

torchvision ships MViTv2-S as a video model (``(B, 3, T, H, W)``, Conv3d / MaxPool3d, a temporal
relative table); on a single frame (its image input, ``(B, 3, H, W)``) it computes a 2-D MViTv2:
every 3-D kernel sees the frame through its centre temporal tap only (zero padding either side),
so each ``(out, in, t, h, w)`` kernel becomes its ``[:, :, t // 2]`` slice, and the temporal term
``q . R_t[0]`` is added to every grid key alike, which is the same as adding the table's
centre row (linearly resampled to one row, as torchvision does at run time) to every row of
``rel_pos_h``. The model that takes the result is vitflow's ``mvit_v2_s``: timm's
``mvitv2_small_cls`` with key / value stride 8 in stage 0 and no residual pooling on the class
token (``residual_pooling="grid"``, torchvision's ``residual_with_cls_embed=False``).

==========================================================  ===================================================
torchvision                                                 timm / vitflow
==========================================================  ===================================================
``conv_proj``                                               ``patch_embed.proj`` (centre temporal tap)
``pos_encoding.class_token`` ``(C,)``                       ``cls_token`` ``(1, 1, C)``
``blocks.{b}.norm1`` / ``norm2``                            ``stages.{i}.blocks.{j}.norm1`` / ``norm2``
``blocks.{b}.attn.qkv`` / ``attn.project.0``                ``...attn.qkv`` / ``attn.proj``
``blocks.{b}.attn.pool_{q,k,v}.pool``                       ``...attn.pool_{q,k,v}`` (centre temporal tap)
``blocks.{b}.attn.pool_{q,k,v}.norm_act.0``                 ``...attn.norm_{q,k,v}``
``blocks.{b}.attn.rel_pos_h`` / ``_w`` (``_t``)             ``...attn.rel_pos_h`` (+ centre of ``_t``) / ``_w``
``blocks.{b}.mlp.0`` / ``mlp.3``                            ``...mlp.fc1`` / ``mlp.fc2``
``blocks.{b}.project``                                      ``...shortcut_proj_attn``
``norm`` / ``head.1``                                       ``norm`` / ``head.fc``
==========================================================  ===================================================

A new stage starts at each block (after the first) with a ``project`` (its width changes), which
is where torchvision's MViTv2 pools its queries. Reference: Li et al. 2022; torchvision's
``models/video/mvit.py``.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
import torch.nn.functional as F

SD = Mapping[str, torch.Tensor]

_RULES = [  # (torchvision block suffix, timm block suffix)
    (r"attn\.project\.0\.", "attn.proj."),
    (r"attn\.pool_([qkv])\.pool\.", r"attn.pool_\1."),
    (r"attn\.pool_([qkv])\.norm_act\.0\.", r"attn.norm_\1."),
    (r"mlp\.0\.", "mlp.fc1."),
    (r"mlp\.3\.", "mlp.fc2."),
    (r"project\.", "shortcut_proj_attn."),
    (r"(norm1|norm2|attn\.qkv|attn\.rel_pos_h|attn\.rel_pos_w)", r"\1"),
]


def is_torchvision_mvit(keys: set[str]) -> bool:
    """True for the names of torchvision's ``MViT`` (``conv_proj``, ``pos_encoding``, ``blocks.0.attn.qkv``)."""
    return {"conv_proj.weight", "pos_encoding.class_token", "blocks.0.attn.qkv.weight"} <= keys


def _stage_map(sd: SD) -> dict[int, tuple[int, int]]:
    """torchvision block index -> (stage, block in stage): a stage starts where a block projects."""
    count = 1 + max(int(m[1]) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    out, stage, j = {}, 0, 0
    for b in range(count):
        if b and f"blocks.{b}.project.weight" in sd:
            stage, j = stage + 1, 0
        out[b] = (stage, j)
        j += 1
    return out


def _centre(t: torch.Tensor) -> torch.Tensor:
    """A 3-D kernel ``(O, I, t, h, w)`` -> its centre temporal tap ``(O, I, h, w)``; 2-D kept."""
    return t[:, :, t.shape[2] // 2] if t.dim() == 5 else t


def _temporal_row(rel_t: torch.Tensor) -> torch.Tensor:
    """The temporal table ``(L, d)`` at offset 0 of a one-frame input: linearly resampled to one
    row (torchvision's ``_interpolate``), ``(d,)``."""
    if rel_t.shape[0] == 1:
        return rel_t[0]
    return F.interpolate(rel_t.t().unsqueeze(0).float(), size=1, mode="linear")[0, :, 0].to(rel_t.dtype)


def torchvision_mvit_to_timm(sd: SD) -> dict[str, torch.Tensor]:
    """Convert a torchvision ``MViT`` (v2) state_dict to timm's names (see the module docstring).

    Raises:
        ValueError: a key with no timm counterpart (an MViT v1 absolute position embedding, or an
            unknown name), naming it.
    """
    stages = _stage_map(sd)
    out: dict[str, torch.Tensor] = {}
    for key, v in sd.items():
        if key in ("conv_proj.weight", "conv_proj.bias"):
            out[key.replace("conv_proj", "patch_embed.proj")] = _centre(v)
        elif key == "pos_encoding.class_token":
            out["cls_token"] = v.reshape(1, 1, -1)
        elif key.startswith(("norm.", "head.1.")):
            out[key.replace("head.1.", "head.fc.")] = v
        elif m := re.match(r"blocks\.(\d+)\.(.+)$", key):
            if m[2] == "attn.rel_pos_t":
                continue  # folded into rel_pos_h below
            s, j = stages[int(m[1])]
            out[f"stages.{s}.blocks.{j}.{_block_name(m[2], key)}"] = _centre(v) if ".pool." in m[2] else v
        else:
            raise ValueError(f"torchvision MViT key {key!r} has no timm counterpart (MViT v1's absolute "
                             "position embedding is not supported)")
    for key, rel_t in sd.items():
        if m := re.match(r"blocks\.(\d+)\.attn\.rel_pos_t$", key):
            s, j = stages[int(m[1])]
            h = f"stages.{s}.blocks.{j}.attn.rel_pos_h"
            out[h] = out[h] + _temporal_row(rel_t).to(out[h].dtype)
    return out


def _block_name(suffix: str, key: str) -> str:
    for pattern, repl in _RULES:
        if re.match(pattern, suffix):
            return re.sub("^" + pattern, repl, suffix)
    raise ValueError(f"torchvision MViT key {key!r} has no timm counterpart")
