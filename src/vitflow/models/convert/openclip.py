"""Convert OpenCLIP / OpenAI CLIP image towers to timm's (= vitflow's) ``vit_*_clip_*`` names.

============================================================  ==================================
OpenCLIP (``visual.`` of a full CLIP checkpoint)              timm
============================================================  ==================================
``conv1.weight`` (no bias)                                    ``patch_embed.proj.weight``
``class_embedding`` (D,)                                      ``cls_token`` (1, 1, D)
``positional_embedding`` (1+N, D)                             ``pos_embed`` (1, 1+N, D)
``ln_pre``                                                    ``norm_pre``
``transformer.resblocks.{i}.ln_1`` / ``ln_2``                 ``blocks.{i}.norm1`` / ``norm2``
``...attn.in_proj_weight`` / ``in_proj_bias`` (rows q, k, v)  ``blocks.{i}.attn.qkv.*``
``...attn.out_proj``                                          ``blocks.{i}.attn.proj``
``...ls_1.gamma`` / ``ls_2.gamma``                            ``blocks.{i}.ls1.gamma`` / ``ls2``
``...mlp.c_fc`` / ``mlp.c_proj``                              ``blocks.{i}.mlp.fc1`` / ``fc2``
``ln_post``                                                   ``norm``
``proj`` (D, P)                                               ``head.weight`` (P, D), zero bias
============================================================  ==================================

The text tower (``transformer.*``, ``token_embedding``, ``text_projection``, ``logit_scale``, ...)
is dropped. OpenCLIP towers built on timm (``visual.trunk.*``) are already in timm names; their
``visual.head.proj`` becomes ``head``. Reference: timm's ``_convert_openai_clip`` in
``vision_transformer.py`` and open_clip's ``VisionTransformer``.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.in_proj_weight": "attn.qkv.weight",
                "attn.in_proj_bias": "attn.qkv.bias", "attn.out_proj": "attn.proj", "ls_1.gamma": "ls1.gamma",
                "ls_2.gamma": "ls2.gamma", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_TOP = {"conv1": "patch_embed.proj", "ln_pre": "norm_pre", "ln_post": "norm"}


def is_openclip(keys: set[str] | Mapping[str, object]) -> bool:
    """Whether a state_dict's keys hold an OpenCLIP / OpenAI CLIP image tower (``visual.*``)."""
    return any(k.removeprefix("module.").startswith(("visual.class_embedding", "visual.trunk.",
                                                     "visual.transformer.resblocks.")) for k in keys)


def _rename(name: str) -> str | None:
    m = _BLOCK.match(name)
    if m:
        for old, new in _BLOCK_NAMES.items():
            if m[2] == old or m[2].startswith(old + "."):
                return f"blocks.{m[1]}.{new}{m[2][len(old):]}"
        return None
    for old, new in _TOP.items():
        if name.startswith(old + "."):
            return new + name[len(old):]
    return None


def convert_openclip(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The image tower of an OpenCLIP / OpenAI CLIP state_dict in timm names.

    Raises:
        ValueError: a ``visual.`` key of no known form (named; e.g. a ResNet tower's ``attnpool``).
    """
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    visual = {k[len("visual."):]: v for k, v in sd.items() if k.startswith("visual.")}
    if any(k.startswith("trunk.") for k in visual):
        out = {k[len("trunk."):]: v for k, v in visual.items() if k.startswith("trunk.")}
        proj = visual.get("head.proj.weight")
        if proj is not None:
            out["head.weight"], out["head.bias"] = proj, torch.zeros(proj.shape[0], dtype=proj.dtype)
        return out
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in visual.items():
        if key == "class_embedding":
            out["cls_token"] = value.reshape(1, 1, -1)
        elif key == "positional_embedding":
            out["pos_embed"] = value.unsqueeze(0)
        elif key == "proj":
            out["head.weight"] = value.t().contiguous()
            out["head.bias"] = torch.zeros(value.shape[1], dtype=value.dtype)
        elif (name := _rename(key)) is not None:
            out[name] = value
        else:
            unknown.append(f"visual.{key}")
    if unknown:
        raise ValueError(f"OpenCLIP image tower with parameters of no ViT form: {unknown[:5]}")
    return out
