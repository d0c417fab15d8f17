"""Hugging Face Swin / Swin V2 checkpoints -> timm's (= vitflow's) Swin names and model name.

``SwinForImageClassification`` / ``Swinv2ForImageClassification`` (``swin.`` / ``swinv2.``
prefix, ``classifier``) and the bare ``SwinModel`` / ``Swinv2Model`` (no prefix, no head)
convert the same way. transformers 4.x names (those of the checkpoints on the Hub) and the 5.x
names of V1 (in brackets) are both read; ``{i}`` a stage, ``{j}`` a block:

=====================================================================  ==========================================
Hugging Face                                                           timm / vitflow
=====================================================================  ==========================================
``embeddings.patch_embeddings.projection``                             ``patch_embed.proj``
``embeddings.norm``                                                    ``patch_embed.norm``
``encoder.layers.{i}.blocks.{j}.layernorm_before`` / ``_after``        ``layers.{i}.blocks.{j}.norm1`` / ``norm2``
``...attention.self.{query,key,value}`` [``attention.{q,k,v}_proj``]   ``...attn.qkv`` (rows q, k, v)
  V2: ``query.bias`` / ``value.bias`` (the key has none)               ``...attn.q_bias`` / ``attn.v_bias``
``...attention.self.relative_position_bias_table``                     ``...attn.relative_position_bias_table``
  [``attention.relative_position_bias.relative_position_bias_table``]
``...attention.self.logit_scale`` (V2)                                 ``...attn.logit_scale``
``...attention.self.continuous_position_bias_mlp.{0,2}`` (V2)          ``...attn.cpb_mlp.{0,2}``
``...attention.output.dense`` [``attention.o_proj``]                   ``...attn.proj``
``...intermediate.dense`` / ``output.dense`` [``mlp.fc1`` / ``fc2``]   ``...mlp.fc1`` / ``mlp.fc2``
``encoder.layers.{i}.downsample.{reduction,norm}``                     ``layers.{i+1}.downsample.{reduction,norm}``
``layernorm``                                                          ``norm``
``classifier``                                                         ``head.fc``
=====================================================================  ==========================================

Hugging Face merges patches at the end of a stage, timm at the start of the next one, hence the
re-indexed ``downsample``. Both concatenate the 2x2 neighbours in the same order (rows
``(0,0), (1,0), (0,1), (1,1)`` of each 2x2 cell, as the original code's ``x0..x3``), so the
``reduction`` columns and the V1 ``norm`` (over ``4C``, before the reduction; V2: over ``2C``,
after it) are copied unchanged. ``relative_position_index`` / ``relative_coords_table`` buffers
(recomputed from the window), ``mask_token``, a SimMIM ``decoder`` and a backbone's
``hidden_states_norms`` are dropped. Absolute position embeddings
(``use_absolute_embeddings=True``) have no timm counterpart and are refused.
Reference: Liu et al. 2021 (Swin), 2022 (Swin V2); timm's ``swin_transformer.py`` /
``swin_transformer_v2.py`` and transformers' ``modeling_swin.py`` / ``modeling_swinv2.py``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping

import torch

log = logging.getLogger(__name__)
SD = Mapping[str, torch.Tensor]

HF_SWIN_TYPES = ("swin", "swinv2")  # config.json model_type values read here

_BLOCK = re.compile(r"^encoder\.layers\.(\d+)\.blocks\.(\d+)\.(.+)$")
_DOWN = re.compile(r"^encoder\.layers\.(\d+)\.downsample\.(reduction|norm)\.(weight|bias)$")
_ATT = r"attention\.(?:self\.)?"
_RULES = [  # (block-suffix pattern without .weight/.bias, timm suffix)
    (r"layernorm_before", "norm1"),
    (r"layernorm_after", "norm2"),
    (_ATT + r"(?:query|q_proj)", "@q"),
    (_ATT + r"(?:key|k_proj)", "@k"),
    (_ATT + r"(?:value|v_proj)", "@v"),
    (r"attention\.(?:output\.dense|o_proj)", "attn.proj"),
    (r"intermediate\.dense|mlp\.fc1", "mlp.fc1"),
    (r"output\.dense|mlp\.fc2", "mlp.fc2"),
    (r"attention\.(?:self|relative_position_bias)\.relative_position_bias_table", "attn.relative_position_bias_table"),
    (_ATT + r"logit_scale", "attn.logit_scale"),
    (_ATT + r"continuous_position_bias_mlp\.0", "attn.cpb_mlp.0"),
    (_ATT + r"continuous_position_bias_mlp\.2", "attn.cpb_mlp.2"),
]
_RULE_RES = [(re.compile(rf"^(?:{p})(?:\.(weight|bias))?$"), t) for p, t in _RULES]
_BUFFERS = re.compile(r"(relative_position_index|relative_coords_table)$")
_TOP = {"embeddings.patch_embeddings.projection": "patch_embed.proj", "embeddings.norm": "patch_embed.norm",
        "layernorm": "norm", "classifier": "head.fc"}
_TOP_DROP = re.compile(r"^(embeddings\.mask_token$|decoder\.|hidden_states_norms\.)")


def _strip_prefix(sd: SD) -> dict[str, torch.Tensor]:
    for prefix in ("swinv2.", "swin."):
        if any(k.startswith(prefix + "embeddings.") for k in sd):
            return {k.removeprefix(prefix): v for k, v in sd.items()}
    return dict(sd)


def detect_hf_swin(keys: set[str] | SD) -> str | None:
    """``"hf_swin"`` / ``"hf_swinv2"`` for the keys of a Hugging Face Swin / Swin V2 state_dict
    (with or without the ``swin.`` / ``swinv2.`` prefix), else None. V2 is told by its
    ``continuous_position_bias_mlp``."""
    stripped = [re.sub(r"^swin(?:v2)?\.", "", k) for k in keys]
    if not any(k.startswith("embeddings.patch_embeddings.projection.") for k in stripped):
        return None
    if not any(_BLOCK.match(k) for k in stripped):
        return None
    return "hf_swinv2" if any("continuous_position_bias_mlp" in k for k in stripped) else "hf_swin"


def hf_swin_to_timm(state_dict: SD, config: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A Hugging Face Swin / Swin V2 state_dict in timm's names (see the module table).

    Args:
        state_dict: ``{name: tensor}`` of ``Swin[v2]ForImageClassification`` or ``Swin[v2]Model``.
        config: the checkpoint's ``config.json`` as a dict (optional; when given, its
            ``model_type`` must agree with the weights and ``use_absolute_embeddings`` is refused).
    Returns:
        ``{timm name: tensor}``; the same tensors (q/k/v weights concatenated along dim 0).
    Raises:
        ValueError: not a Swin state_dict, absolute position embeddings, a block without all of
        query/key/value, or a key of no known form (named).
    """
    kind = detect_hf_swin(set(state_dict))
    if kind is None:
        raise ValueError("not a Hugging Face Swin state_dict (no embeddings.patch_embeddings.projection / "
                         "encoder.layers.N.blocks.N keys)")
    v2 = kind == "hf_swinv2"
    if config is not None:
        _check_config(config, v2)
    sd = _strip_prefix(state_dict)
    if "embeddings.position_embeddings" in sd:
        raise ValueError("embeddings.position_embeddings: absolute position embeddings (use_absolute_embeddings="
                         "True) have no counterpart in timm's / vitflow's Swin")
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], torch.Tensor] = {}
    unknown, dropped = [], []
    for key, value in sd.items():
        if m := _BLOCK.match(key):
            _block_key(f"layers.{m[1]}.blocks.{m[2]}.", m[3], value, out, qkv, unknown, key)
        elif m := _DOWN.match(key):
            out[f"layers.{int(m[1]) + 1}.downsample.{m[2]}.{m[3]}"] = value
        elif _TOP_DROP.match(key):
            dropped.append(key)
        else:
            old = next((o for o in _TOP if key.startswith(o + ".")), None)
            if old is None:
                unknown.append(key)
            else:
                out[_TOP[old] + key[len(old):]] = value
    if unknown:
        raise ValueError(f"unknown Hugging Face Swin parameters {unknown[:5]}")
    if dropped:
        log.info("dropped %d Swin tensors with no classifier counterpart (e.g. %s)", len(dropped), dropped[0])
    out.update(_fuse_qkv(qkv, v2))
    return out


def _block_key(block: str, suffix: str, value: torch.Tensor, out: dict, qkv: dict, unknown: list, key: str) -> None:
    """Place one block parameter (``suffix`` of block prefix ``block``) into ``out`` / ``qkv``."""
    if _BUFFERS.search(suffix):
        return
    for pattern, target in _RULE_RES:
        hit = pattern.match(suffix)
        if hit:
            kind = hit[1] or ""
            if target.startswith("@"):
                qkv[(block, target[1] + kind)] = value
            else:
                out[block + target + (f".{kind}" if kind else "")] = value
            return
    unknown.append(key)


def _fuse_qkv(qkv: dict[tuple[str, str], torch.Tensor], v2: bool) -> dict[str, torch.Tensor]:
    """Per block: ``attn.qkv.weight`` = cat(q, k, v); biases fused into ``attn.qkv.bias`` (V1, a
    missing one zero) or kept as ``attn.q_bias`` / ``attn.v_bias`` (V2: timm's k bias is a zero
    buffer; a non-zero k bias would be refused)."""
    out: dict[str, torch.Tensor] = {}
    for block in sorted({b for b, _ in qkv}):
        parts = {n: qkv.get((block, n + "weight")) for n in "qkv"}
        if any(p is None for p in parts.values()):
            have = sorted(n for n, p in parts.items() if p is not None)
            raise ValueError(f"Swin block {block.rstrip('.')}: weights of {have} only, need query/key/value")
        out[block + "attn.qkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
        bias = {n: qkv.get((block, n + "bias")) for n in "qkv"}
        if all(b is None for b in bias.values()):
            continue
        zero = torch.zeros_like(parts["q"][:, 0])
        if v2:
            if bias["k"] is not None and bias["k"].abs().max() > 0:
                raise ValueError(f"Swin V2 block {block.rstrip('.')}: a non-zero key bias (timm's V2 has none)")
            out[block + "attn.q_bias"] = zero if bias["q"] is None else bias["q"]
            out[block + "attn.v_bias"] = zero if bias["v"] is None else bias["v"]
        else:
            out[block + "attn.qkv.bias"] = torch.cat([zero if bias[n] is None else bias[n] for n in "qkv"])
    return out


def _check_config(config: Mapping[str, Any], v2: bool) -> None:
    kind = config.get("model_type")
    if kind in HF_SWIN_TYPES and (kind == "swinv2") != v2:
        raise ValueError(f"config.json says model_type {kind!r} but the weights are Swin {'V2' if v2 else 'V1'}")
    if config.get("use_absolute_embeddings"):
        raise ValueError("config.json: use_absolute_embeddings=true has no counterpart in timm's / vitflow's Swin")



# --------------------------------------------------------------------------------------------
# config.json -> timm model name + constructor keys

_V1_HEADS = {96: (3, 6, 12, 24), 128: (4, 8, 16, 32), 192: (6, 12, 24, 48)}
_V1_SIZES = {"tiny": (96, (2, 2, 6, 2)), "small": (96, (2, 2, 18, 2)), "base": (128, (2, 2, 18, 2)),
             "large": (192, (2, 2, 18, 2))}
# timm's registered names (timm 1.0): version -> [(name, constructor args)], most used first
TIMM_SWIN_NAMES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "swin": [(f"swin_{s}_patch4_window{w}_{img}", {"embed_dim": d, "depths": depths, "num_heads": _V1_HEADS[d],
                                                   "window_size": w, "img_size": img, "patch_size": 4})
             for s, (d, depths) in _V1_SIZES.items() for w, img in ((7, 224), (12, 384))
             if w == 7 or s in ("base", "large")],
    "swinv2": [(f"swinv2_{s}_window{w}_{img}", {"embed_dim": d, "depths": depths, "num_heads": _V1_HEADS[d],
                                                "window_size": w, "img_size": img, "patch_size": 4})
               for s, (d, depths) in _V1_SIZES.items() for w, img in ((8, 256), (16, 256), (12, 192))
               if (s == "large") == (w == 12) or (s == "base" and w == 12)]
    + [(f"swinv2_{s}_window12to{w}_192to{img}", {"embed_dim": d, "depths": (2, 2, 18, 2), "num_heads": _V1_HEADS[d],
                                                 "window_size": w, "img_size": img, "patch_size": 4,
                                                 "pretrained_window_sizes": (12, 12, 12, 6)})
       for s, d in (("base", 128), ("large", 192)) for w, img in ((16, 256), (24, 384))],
}
_DEFAULTS = {"mlp_ratio": 4.0, "qkv_bias": True, "in_chans": 3}


def hf_swin_model_args(config: Mapping[str, Any], where: str = "config.json") -> tuple[str, dict[str, Any]]:
    """The timm (= vitflow) model name and constructor keys a transformers Swin / Swin V2
    ``config.json`` describes.

    The name is timm's registered one when the sizes match it exactly (embed_dim 96, depths
    [2,2,6,2], heads [3,6,12,24], window 7, image 224 -> ``swin_tiny_patch4_window7_224``); else
    the nearest registered name of that version (fewest differing sizes) with the differing sizes
    as explicit keys (``embed_dim``, ``depths``, ``num_heads``, ``window_size``, ``patch_size``,
    ``mlp_ratio``, ``qkv_bias``, ``in_chans``, ``pretrained_window_sizes``). ``img_size`` is
    always given; ``num_classes`` = the number of labels for a ``...ForImageClassification``.

    Raises:
        ValueError: not a Swin config, non-square image/patch/window sizes, absolute position
        embeddings, an activation other than GELU, or depths and heads of different lengths.
    """
    kind = config.get("model_type")
    if kind not in HF_SWIN_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not a Swin (one of {', '.join(HF_SWIN_TYPES)})")
    args = _config_sizes(config, where)
    if config.get("use_absolute_embeddings"):
        raise ValueError(f"{where}: use_absolute_embeddings=true has no counterpart in timm's / vitflow's Swin")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r}: timm's / vitflow's Swin use GELU")
    if abs(float(config.get("layer_norm_eps", 1e-5)) - 1e-5) > 1e-12:
        log.info("%s: layer_norm_eps %s, timm's Swin uses 1e-5 (outputs differ slightly)", where,
                 config["layer_norm_eps"])
    name, named = min(TIMM_SWIN_NAMES[kind], key=lambda item: sum(
        args.get(k, _DEFAULTS.get(k)) != item[1].get(k, _DEFAULTS.get(k)) for k in {*args, *item[1]}))
    kwargs = {k: v for k, v in args.items() if v != named.get(k, _DEFAULTS.get(k)) and k != "img_size"}
    kwargs["img_size"] = args["img_size"]
    labels = hf_swin_label_names(config)
    if labels:
        kwargs["num_classes"] = len(labels)
    return name, kwargs


def hf_swin_label_names(config: Mapping[str, Any]) -> list[str] | None:
    """The class names of a ``...ForImageClassification`` config (``id2label`` in index order), else None."""
    labels = config.get("id2label")
    if not isinstance(labels, dict) or not str((config.get("architectures") or [""])[0]).endswith(
            "ForImageClassification"):
        return None
    return [labels[k] for k in sorted(labels, key=int)]


def _square(value: Any, key: str, where: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"{where}: {key} {list(value)} is not square (timm's Swin names take one size)")
        value = value[0]
    return int(value)


def _config_sizes(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The architecture of a Swin config.json as timm constructor keys (HF's defaults filled in)."""
    try:
        depths = tuple(int(d) for d in config.get("depths", (2, 2, 6, 2)))
        heads = tuple(int(h) for h in config.get("num_heads", (3, 6, 12, 24)))
        args: dict[str, Any] = {
            "embed_dim": int(config.get("embed_dim", 96)), "depths": depths, "num_heads": heads,
            "window_size": _square(config.get("window_size", 7), "window_size", where),
            "img_size": _square(config.get("image_size", 224), "image_size", where),
            "patch_size": _square(config.get("patch_size", 4), "patch_size", where),
            "mlp_ratio": float(config.get("mlp_ratio", 4.0)), "qkv_bias": bool(config.get("qkv_bias", True)),
            "in_chans": int(config.get("num_channels", 3))}
        pretrained = tuple(int(p) for p in config.get("pretrained_window_sizes") or ())[:len(depths)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: unusable Swin sizes ({e})") from None
    if len(heads) != len(depths):
        raise ValueError(f"{where}: depths {list(depths)} and num_heads {list(heads)} differ in length")
    if config.get("model_type") == "swinv2" and any(pretrained):
        args["pretrained_window_sizes"] = pretrained
    return args


def swin_model_config_keys(kwargs: Mapping[str, Any], model_cfg: Any, explicit: set[str]) -> dict[str, Any]:
    """The keys of :func:`hf_swin_model_args` that ``model.name=auto`` sets on ``model_cfg`` (a
    :class:`vitflow.config.SwinConfig`): every architecture key but ``img_size`` /
    ``num_classes`` (taken elsewhere) and those in ``explicit`` (``"model.KEY"``), where the
    config has a field of that kind (a list/tuple value needs a tuple field: ``depths``,
    ``num_heads``).

    Raises:
        vitflow.config.ConfigError: a key the model config cannot hold (``qkv_bias``, ``in_chans``,
        V2's ``pretrained_window_sizes``), naming the keys and their values, so that no other
        architecture is built silently.
    """
    from dataclasses import fields

    from vitflow.config import ConfigError

    kinds = {f.name: str(f.type) for f in fields(model_cfg)}
    taken, unfit = {}, []
    for key, value in kwargs.items():
        if key in ("img_size", "num_classes") or f"model.{key}" in explicit:
            continue
        seq = isinstance(value, (list, tuple))
        if key in kinds and seq == any(t in kinds[key] for t in ("tuple", "list")):
            taken[key] = tuple(value) if seq else value
        else:
            unfit.append(f"{key}={list(value) if seq else value}")
    if unfit:
        raise ConfigError(f"model.name=auto: the Swin config needs {', '.join(unfit)}, which the model.* keys "
                          "cannot express; build it with vitflow.models.pretrained.config.create_pretrained_model "
                          "or a named model", "model.name")
    return taken
