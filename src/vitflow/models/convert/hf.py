"""Convert Hugging Face ``transformers`` image backbones to timm's (= vitflow's) parameter names.

Families (transformers 5.x names; the 4.x names of the checkpoints on the Hub in brackets):

==========================  ================================================  ==========================
transformers class          embeddings / head                                 timm model
==========================  ================================================  ==========================
``Dinov2Model``             ``embeddings.cls_token``, ``position_embeddings``  ``vit_*_patch14_dinov2``
                            (1+N), ``patch_embeddings.projection``, ``layernorm``
``Dinov2WithRegisters``     + ``register_tokens``; position 0 (the class       ``vit_*_patch14_reg4_dinov2``
                            token's) is folded into ``cls_token``, as timm     (``no_embed_class``)
``DINOv3ViTModel``          ``cls_token``, ``register_tokens``,                ``vit_*_patch16_dinov3*``
                            ``patch_embeddings`` (a conv), 2-D RoPE (no        (timm's ``Eva``)
                            weights), ``model.layer.{i}``, ``norm``
``CLIPVisionModel``         ``class_embedding`` (D,), ``position_embedding``   ``vit_*_clip_*``
                            (1+N, D), ``pre_layrnorm`` -> ``norm_pre``,        (``pre_norm``)
                            ``post_layernorm`` -> ``norm``; ``CLIPModel``:
                            ``visual_projection`` -> ``head`` (zero bias)
``SiglipVisionModel``       ``position_embedding`` (N, D), no class token,     ``vit_*_siglip_*``
                            ``head.{probe,attention,layernorm,mlp}`` ->        (``global_pool='map'``)
                            ``attn_pool.{latent,q+kv,proj,norm,mlp}``
``BeitModel`` /             ``beit.`` prefix, per-block                        ``beit_*``
``BeitForImage...``         ``relative_position_bias_table``, ``lambda_1/2``
                            -> ``gamma_1/2``, ``pooler.layernorm`` ->
                            ``fc_norm``, ``classifier`` -> ``head``
==========================  ================================================  ==========================

In every block: ``norm1`` [``layernorm_before``, ``layer_norm1``], ``norm2``
[``layernorm_after``, ``layer_norm2``], ``q/k/v_proj`` [``attention.attention.query/key/value``]
fused into ``attn.qkv`` (rows q, k, v; a missing k bias is zero; BEiT / EVA keep ``q_bias`` and
``v_bias`` apart as timm does), ``o_proj`` [``attention.output.dense``, ``self_attn.out_proj``]
-> ``attn.proj``, ``fc1/fc2`` [``intermediate.dense`` / ``output.dense``, ``up_proj`` /
``down_proj``] -> ``mlp.fc1/fc2``, LayerScale -> ``ls1.gamma`` (ViT) or ``gamma_1`` (BEiT, EVA).
Text towers, ``mask_token``, ``logit_scale``, position ids and relative position index buffers
have no counterpart and are dropped. Reference: timm's ``checkpoint_filter_fn`` of
``vision_transformer.py`` / ``beit.py`` / ``eva.py`` and transformers' modeling files.
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Mapping

import torch

log = logging.getLogger(__name__)
SD = Mapping[str, torch.Tensor]

_CONTAINER = re.compile(r"^(?:encoder\.layers?|model\.layer|layers?)\.(\d+)\.(.+)$")
_BLOCK_RULES = [  # (suffix pattern without .weight/.bias, timm suffix; q/k/v are fused afterwards)
    (r"norm1|layernorm_before|layer_norm1", "norm1"),
    (r"norm2|layernorm_after|layer_norm2", "norm2"),
    (r"(?:attention\.attention|attention|self_attn)\.(?:query|q_proj)", "@q"),
    (r"(?:attention\.attention|attention|self_attn)\.(?:key|k_proj)", "@k"),
    (r"(?:attention\.attention|attention|self_attn)\.(?:value|v_proj)", "@v"),
    (r"attention\.output\.dense|attention\.o_proj|self_attn\.out_proj", "attn.proj"),
    (r"layer_scale1\.lambda1|lambda_1", "@ls1"),
    (r"layer_scale2\.lambda1|lambda_2", "@ls2"),
    (r"mlp\.gate_proj", "mlp.fc1_g"),
    (r"mlp\.fc1|intermediate\.dense|mlp\.up_proj|mlp\.weights_in", "@fc1"),
    (r"mlp\.fc2|output\.dense|mlp\.down_proj|mlp\.weights_out", "mlp.fc2"),
    (r"(?:attention\.attention\.|attention\.)?relative_position_bias\.relative_position_bias_table",
     "attn.relative_position_bias_table"),
]
_BLOCK_RES = [(re.compile(rf"^(?:{p})(?:\.(weight|bias))?$"), t) for p, t in _BLOCK_RULES]
_BLOCK_DROP = re.compile(r"relative_position_index$")


def _strip(sd: SD, *prefixes: str) -> dict[str, torch.Tensor]:
    """``sd`` with the first of ``prefixes`` that some key carries removed (keys without it kept)."""
    for p in prefixes:
        if any(k.startswith(p) for k in sd):
            return {k.removeprefix(p): v for k, v in sd.items()}
    return dict(sd)


def convert_blocks(sd: SD, ls: str = "ls{}.gamma", qkv: str = "fused") -> tuple[dict[str, torch.Tensor], list[str]]:
    """The transformer blocks of a Hugging Face state_dict (any key matching ``..layer(s).{i}.``)
    in timm names, and the keys that were not block keys.

    Args:
        ls: the LayerScale name, ``"ls{}.gamma"`` (timm ViT) or ``"gamma_{}"`` (BEiT, EVA).
        qkv: ``"fused"``: q/k/v weights and biases concatenated into ``attn.qkv.{weight,bias}`` (a
            missing bias is zero); ``"split_bias"``: weights concatenated, ``attn.q_bias`` /
            ``attn.v_bias`` apart (timm's BEiT / EVA), the k bias must be absent or zero.
    Raises:
        ValueError: a block key of no known form (named).
    """
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, str, str], torch.Tensor] = {}
    rest = []
    gated = any(k.endswith("mlp.gate_proj.weight") for k in sd)
    for key, value in sd.items():
        m = _CONTAINER.match(key)
        if not m:
            rest.append(key)
            continue
        i, suffix = int(m[1]), m[2]
        if _BLOCK_DROP.search(suffix):
            continue
        for pattern, target in _BLOCK_RES:
            hit = pattern.match(suffix)
            if hit:
                kind = hit[1] or ""
                break
        else:
            raise ValueError(f"unknown block parameter {key!r}")
        if target in ("@q", "@k", "@v"):
            parts[(i, target[1], kind)] = value
        elif target.startswith("@ls"):
            out[f"blocks.{i}.{ls.format(target[3])}"] = value
        elif target == "@fc1":
            out[f"blocks.{i}.mlp.{'fc1_x' if gated else 'fc1'}.{kind}"] = value
        else:
            out[f"blocks.{i}.{target}" + (f".{kind}" if kind else "")] = value
    for i in sorted({i for i, _, _ in parts}):
        q, k, v = (parts[(i, n, "weight")] for n in "qkv")
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
        biases = [parts.get((i, n, "bias")) for n in "qkv"]
        if all(b is None for b in biases):
            continue
        biases = [torch.zeros(q.shape[0], dtype=q.dtype) if b is None else b for b in biases]
        if qkv == "fused":
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat(biases)
        else:
            if biases[1].abs().max() > 0:
                log.warning("block %d: dropping a non-zero k bias (timm's layout has none; softmax ignores it)", i)
            out[f"blocks.{i}.attn.q_bias"], out[f"blocks.{i}.attn.v_bias"] = biases[0], biases[2]
    return out, rest


def _rename(sd: SD, keys: list[str], table: Mapping[str, str], drop: str) -> dict[str, torch.Tensor]:
    """``keys`` of ``sd`` renamed by prefix ``table`` (first match); keys matching regex ``drop``
    are dropped. Raises ValueError naming the keys of no known form."""
    out, unknown = {}, []
    for key in keys:
        if re.search(drop, key):
            continue
        for old, new in table.items():
            if key == old or key.startswith(old + "."):
                out[new + key[len(old):]] = sd[key]
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"unknown parameters {unknown[:5]}")
    return out


def convert_hf_dinov2(sd: SD) -> dict[str, torch.Tensor]:
    """``Dinov2Model`` / ``Dinov2WithRegistersModel`` (or ``dinov2.``-prefixed) -> timm's
    ``vit_*_patch14_dinov2`` / ``vit_*_patch14_reg4_dinov2``. With registers, the class token's
    position (row 0) is added to ``cls_token`` and dropped from ``pos_embed`` (timm's
    ``no_embed_class`` layout). A classification head (``classifier``, on class token + mean) has
    no timm counterpart and is dropped."""
    sd = _strip(sd, "dinov2.")
    out, rest = convert_blocks(sd)
    out.update(_rename(sd, rest, {"embeddings.cls_token": "cls_token", "embeddings.register_tokens": "reg_token",
                                  "embeddings.position_embeddings": "pos_embed",
                                  "embeddings.patch_embeddings.projection": "patch_embed.proj",
                                  "layernorm": "norm"}, r"^(embeddings\.mask_token|classifier\.)"))
    if "reg_token" in out:
        pos = out["pos_embed"]
        out["cls_token"] = out["cls_token"] + pos[:, :1]
        out["pos_embed"] = pos[:, 1:]
    return out


def convert_hf_dinov3(sd: SD) -> dict[str, torch.Tensor]:
    """``DINOv3ViTModel`` -> timm's ``Eva`` layout of ``vit_*_patch16_dinov3[_qkvb]`` (q/v biases
    as ``attn.q_bias`` / ``attn.v_bias``, LayerScale ``gamma_1/2``, a gated MLP as
    ``mlp.fc1_g`` / ``fc1_x`` / ``fc2``). RoPE has no weights."""
    sd = _strip(sd, "dinov3.")
    out, rest = convert_blocks(sd, ls="gamma_{}", qkv="split_bias")
    out.update(_rename(sd, rest, {"embeddings.cls_token": "cls_token", "embeddings.register_tokens": "reg_token",
                                  "embeddings.patch_embeddings": "patch_embed.proj", "norm": "norm"},
                       r"^(embeddings\.mask_token|rope_embeddings\.)"))
    if "reg_token" in out and out["reg_token"].shape[1] == 0:
        out.pop("reg_token")
    return out


def convert_hf_clip(sd: SD) -> dict[str, torch.Tensor]:
    """``CLIPVisionModel`` / ``CLIPModel`` (vision tower) -> timm's ``vit_*_clip_*``
    (``pre_norm=True``, no patch bias). A full ``CLIPModel``'s ``visual_projection`` (P, D)
    becomes ``head.weight`` with a zero ``head.bias`` (timm's CLIP heads)."""
    proj = sd.get("visual_projection.weight")
    sd = {k: v for k, v in _strip(sd, "vision_model.").items()
          if not k.startswith(("text_model.", "text_projection", "logit_", "visual_projection"))}
    out, rest = convert_blocks(sd)
    out.update(_rename(sd, rest, {"embeddings.class_embedding": "cls_token",
                                  "embeddings.patch_embedding": "patch_embed.proj",
                                  "embeddings.position_embedding.weight": "pos_embed",
                                  "pre_layrnorm": "norm_pre", "post_layernorm": "norm"},
                       r"position_ids$"))
    out["cls_token"] = out["cls_token"].reshape(1, 1, -1)
    out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    if proj is not None:
        out["head.weight"], out["head.bias"] = proj, torch.zeros(proj.shape[0], dtype=proj.dtype)
    return out


def convert_hf_siglip(sd: SD) -> dict[str, torch.Tensor]:
    """``SiglipVisionModel`` / ``SiglipModel`` (vision tower; SigLIP 2's fixed-size towers alike)
    -> timm's ``vit_*_siglip_*``: no class token, position embedding (N, D), the MAP head
    (``head.probe``, ``nn.MultiheadAttention`` in-projection split into ``attn_pool.q`` and
    ``attn_pool.kv``)."""
    sd = {k: v for k, v in _strip(sd, "vision_model.").items()
          if not k.startswith(("text_model.", "logit_"))}
    out, rest = convert_blocks(sd)
    w, b = sd.get("head.attention.in_proj_weight"), sd.get("head.attention.in_proj_bias")
    if w is not None:
        dim = w.shape[1]
        out["attn_pool.q.weight"], out["attn_pool.kv.weight"] = w[:dim], w[dim:]
        if b is not None:
            out["attn_pool.q.bias"], out["attn_pool.kv.bias"] = b[:dim], b[dim:]
    rest = [k for k in rest if not k.startswith("head.attention.in_proj_")]
    out.update(_rename(sd, rest, {"embeddings.patch_embedding": "patch_embed.proj",
                                  "embeddings.position_embedding.weight": "pos_embed", "post_layernorm": "norm",
                                  "head.probe": "attn_pool.latent", "head.attention.out_proj": "attn_pool.proj",
                                  "head.layernorm": "attn_pool.norm", "head.mlp": "attn_pool.mlp"},
                       r"position_ids$"))
    out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    return out


def convert_hf_beit(sd: SD) -> dict[str, torch.Tensor]:
    """``BeitModel`` / ``BeitForImageClassification`` -> timm's ``beit_*``: q/v biases apart,
    per-block (or shared: ``rel_pos_bias``) relative position tables, ``lambda_1/2`` ->
    ``gamma_1/2``, mean-pooling ``pooler.layernorm`` -> ``fc_norm``, ``classifier`` -> ``head``."""
    sd = _strip(sd, "beit.")
    out, rest = convert_blocks(sd, ls="gamma_{}", qkv="split_bias")
    out.update(_rename(sd, rest, {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
                                  "embeddings.patch_embeddings.projection": "patch_embed.proj",
                                  "encoder.relative_position_bias": "rel_pos_bias",
                                  "pooler.layernorm": "fc_norm", "layernorm": "norm", "classifier": "head"},
                       r"(^embeddings\.mask_token|relative_position_index)$"))
    return out


CONVERTERS: dict[str, Callable[[SD], dict[str, torch.Tensor]]] = {
    "hf_dinov2": convert_hf_dinov2, "hf_dinov3": convert_hf_dinov3, "hf_clip": convert_hf_clip,
    "hf_siglip": convert_hf_siglip, "hf_beit": convert_hf_beit,
}


def detect_hf_layout(keys: set[str]) -> str | None:
    """The Hugging Face family of a state_dict's ``keys`` (a key of :data:`CONVERTERS`), or None."""
    def has(*parts: str) -> bool:
        return any(p in k for k in keys for p in parts)

    if has("embeddings.class_embedding"):
        return "hf_clip"
    if has("embeddings.patch_embedding.weight") and has("post_layernorm"):
        return "hf_siglip"
    if has("model.layer.0.layer_scale1") or (has("embeddings.patch_embeddings.weight") and has("layer_scale1")):
        return "hf_dinov3"
    if has("layer_scale1.lambda1"):
        return "hf_dinov2"
    if has("lambda_1", "relative_position_bias.relative_position_bias_table", "beit."):
        return "hf_beit"
    return None
