"""Convert foreign ViT checkpoints to (and from) vitflow's timm-layout state_dict.

Hugging Face ``ViTForImageClassification`` / ``ViTModel`` (transformers 4.x names; the 5.x
names in brackets), ``{i}`` the layer index:

=====================================================================  =========================
Hugging Face                                                           vitflow / timm
=====================================================================  =========================
``vit.embeddings.cls_token``                                           ``cls_token``
``vit.embeddings.position_embeddings``                                 ``pos_embed``
``vit.embeddings.patch_embeddings.projection.{weight,bias}``           ``patch_embed.proj.*``
``vit.encoder.layer.{i}.layernorm_before`` [``vit.layers.{i}...``]     ``blocks.{i}.norm1``
``...attention.attention.{query,key,value}`` [``attention.{q,k,v}_proj``]  ``blocks.{i}.attn.qkv`` (rows q, k, v)
``...attention.output.dense`` [``attention.o_proj``]                   ``blocks.{i}.attn.proj``
``...layernorm_after``                                                 ``blocks.{i}.norm2``
``...intermediate.dense`` [``mlp.fc1``]                                ``blocks.{i}.mlp.fc1``
``...output.dense`` [``mlp.fc2``]                                      ``blocks.{i}.mlp.fc2``
``vit.layernorm``                                                      ``norm``
``classifier``                                                         ``head``
=====================================================================  =========================

A ``ViTModel`` state_dict (no ``vit.`` prefix) converts the same way; ``pooler.*`` and
``mask_token`` have no counterpart and are dropped. Hugging Face's ViT configs use LayerNorm
eps 1e-12 where vitflow (like timm and the original JAX code) uses 1e-6; the difference in
outputs is of order 1e-6.

Google ``vision_transformer`` / ``big_vision`` ``.npz`` (Flax; kernels are ``(in, out)``,
attention kernels ``(D, H, d)`` and ``(H, d, D)``, the patch kernel ``(p, p, C, D)``):

=====================================================================  =========================
vision_transformer (big_vision where different)                        vitflow / timm
=====================================================================  =========================
``embedding/kernel`` ``(p,p,C,D)`` -> permute to ``(D,C,p,p)``         ``patch_embed.proj.weight``
``embedding/bias``                                                     ``patch_embed.proj.bias``
``cls``                                                                ``cls_token``
``Transformer/posembed_input/pos_embedding`` (``pos_embedding``)        ``pos_embed``
``Transformer/encoderblock_{i}/LayerNorm_0/{scale,bias}``              ``blocks.{i}.norm1.{weight,bias}``
``.../MultiHeadDotProductAttention_1/{query,key,value}/kernel``        ``blocks.{i}.attn.qkv.weight``
  (``MultiHeadDotProductAttention_0``) ``(D,H,d)`` -> ``(H*d, D)``
``.../MultiHeadDotProductAttention_1/{query,key,value}/bias`` ``(H,d)`` ``blocks.{i}.attn.qkv.bias``
``.../MultiHeadDotProductAttention_1/out/kernel`` ``(H,d,D)`` -> ``(D, H*d)``  ``blocks.{i}.attn.proj.weight``
``.../LayerNorm_2`` (``LayerNorm_1``)                                  ``blocks.{i}.norm2``
``.../MlpBlock_3/Dense_0`` (``MlpBlock_0/Dense_0``), kernel transposed ``blocks.{i}.mlp.fc1``
``.../MlpBlock_3/Dense_1`` (``MlpBlock_0/Dense_1``)                    ``blocks.{i}.mlp.fc2``
``Transformer/encoder_norm/{scale,bias}``                              ``norm``
``head/{kernel,bias}``                                                 ``head``
=====================================================================  =========================

Keys may carry a prefix (``opt/target/``, ``params/``, ``params/img/``, ``img/``); big_vision
checkpoints trained with ``scan`` stack the blocks as ``Transformer/encoderblock/...`` with a
leading depth axis. ``pre_logits`` (a representation layer of old ImageNet-21k checkpoints) is
dropped with a warning, as timm does. Checkpoints without a class token (``gap`` pooling) are
refused: Flax normalises the tokens before pooling, vitflow's ``avg`` pooling after (as timm /
MAE). Files are read with ``numpy.load(allow_pickle=False)``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Hugging Face

_HF_RULES = [  # (pattern on the name without the "vit." prefix, replacement)
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.layernorm_before\.", r"blocks.\1.norm1."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.layernorm_after\.", r"blocks.\1.norm2."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attn.proj."),
    (r"^layers\.(\d+)\.attention\.o_proj\.", r"blocks.\1.attn.proj."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.mlp.fc2."),
    (r"^layers\.(\d+)\.mlp\.(fc[12])\.", r"blocks.\1.mlp.\2."),
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
]
_HF_QKV = re.compile(r"^(?:encoder\.layer|layers)\.(\d+)\.attention\.(?:attention\.)?(query|key|value|[qkv]_proj)\."
                     r"(weight|bias)$")
_HF_DROP = re.compile(r"^(pooler\.|embeddings\.mask_token$)")


def is_hf_vit(sd: Mapping[str, object]) -> bool:
    """True for a Hugging Face ViT state_dict (``vit.embeddings...`` or ``embeddings...`` keys)."""
    return any(k.startswith(("vit.embeddings.", "embeddings.patch_embeddings.")) for k in sd)


def convert_hf_vit(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face ViT state_dict -> vitflow / timm names (see the module table).

    Raises:
        ValueError: a key with no mapping, or a layer without all of query, key and value.
    """
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, value in sd.items():
        key = name.removeprefix("vit.")
        if _HF_DROP.match(key):
            continue
        if m := _HF_QKV.match(key):
            part = m.group(2)[0]  # q / k / v
            qkv.setdefault((m.group(1), m.group(3)), {})[part] = value
            continue
        for pattern, repl in _HF_RULES:
            new, n = re.subn(pattern, repl, key)
            if n:
                out[new] = value
                break
        else:
            raise ValueError(f"Hugging Face ViT key {name!r} has no vitflow counterpart")
    for (layer, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ValueError(f"Hugging Face ViT layer {layer}: {kind} of {sorted(parts)} only, need query/key/value")
        out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


# --------------------------------------------------------------------------------------------
# Google vision_transformer / big_vision .npz

_NPZ_PREFIXES = ("opt/target/", "params/img/", "params/", "img/")


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    """All arrays of an ``.npz`` file (``allow_pickle=False``: no code is run)."""
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def convert_jax_npz(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Flax ViT arrays (vision_transformer or big_vision names) -> vitflow / timm state_dict.

    Raises:
        ValueError: no ``embedding/kernel`` under any known prefix, an unsupported head (MAP
        pooling), or missing block entries (named).
    """
    prefix = next((p for p in ("",) + _NPZ_PREFIXES if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise ValueError("not a ViT .npz checkpoint: no 'embedding/kernel' (under '', "
                         + ", ".join(repr(p) for p in _NPZ_PREFIXES) + ")")
    w = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    if any(k.startswith("MAPHead_0/") for k in w):
        raise ValueError("big_vision MAP-head checkpoints are not supported (vitflow pools by class token or mean)")
    big_vision = "pos_embedding" in w or "Transformer/encoderblock/LayerNorm_0/scale" in w
    mha, ln2, mlp = ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0") if big_vision else \
        ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).float()

    sd: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": t(w["embedding/kernel"]).permute(3, 2, 0, 1).contiguous(),
        "patch_embed.proj.bias": t(w["embedding/bias"]),
    }
    if "cls" not in w:
        raise ValueError("global-average-pooled .npz checkpoints (no 'cls') are not supported: the Flax ViT "
                         "normalises tokens before pooling, vitflow's avg pooling after (as timm / MAE)")
    sd["cls_token"] = t(w["cls"])
    pos_key = "pos_embedding" if big_vision else "Transformer/posembed_input/pos_embedding"
    if pos_key in w:
        sd["pos_embed"] = t(w[pos_key]).reshape(1, -1, w[pos_key].shape[-1])
    sd["norm.weight"], sd["norm.bias"] = t(w["Transformer/encoder_norm/scale"]), t(w["Transformer/encoder_norm/bias"])
    if "head/kernel" in w:
        sd["head.weight"], sd["head.bias"] = t(w["head/kernel"]).T.contiguous(), t(w["head/bias"])
    if "pre_logits/kernel" in w:
        log.warning("dropping the pre_logits representation layer of this .npz checkpoint (as timm does)")

    sd.update(_npz_blocks(w, prefix, mha, ln2, mlp, t))
    return sd


def _npz_blocks(w: Mapping[str, np.ndarray], prefix: str, mha: str, ln2: str, mlp: str,
                t: Callable[[np.ndarray], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``blocks.{i}.*`` tensors of a Flax ViT's encoder blocks (one ``encoderblock_{i}`` each,
    or a scanned ``encoderblock`` whose arrays have a leading depth axis); ``mha``, ``ln2``,
    ``mlp``: that checkpoint's module names."""
    scanned = "Transformer/encoderblock/LayerNorm_0/scale" in w
    if scanned:
        depth = w["Transformer/encoderblock/LayerNorm_0/scale"].shape[0]
    else:
        depth = len({m.group(1) for k in w if (m := re.match(r"Transformer/encoderblock_(\d+)/", k))})

    def get(i: int, sub: str) -> torch.Tensor:
        key = f"Transformer/encoderblock/{sub}" if scanned else f"Transformer/encoderblock_{i}/{sub}"
        if key not in w:
            raise ValueError(f".npz checkpoint lacks {prefix}{key}")
        return t(w[key][i] if scanned else w[key])

    sd: dict[str, torch.Tensor] = {}
    for i in range(depth):
        b = f"blocks.{i}."
        sd[b + "norm1.weight"], sd[b + "norm1.bias"] = get(i, "LayerNorm_0/scale"), get(i, "LayerNorm_0/bias")
        sd[b + "attn.qkv.weight"] = torch.cat([get(i, f"{mha}/{n}/kernel").flatten(1).T for n in ("query", "key", "value")])
        sd[b + "attn.qkv.bias"] = torch.cat([get(i, f"{mha}/{n}/bias").reshape(-1) for n in ("query", "key", "value")])
        sd[b + "attn.proj.weight"] = get(i, f"{mha}/out/kernel").flatten(0, 1).T.contiguous()
        sd[b + "attn.proj.bias"] = get(i, f"{mha}/out/bias")
        sd[b + "norm2.weight"], sd[b + "norm2.bias"] = get(i, f"{ln2}/scale"), get(i, f"{ln2}/bias")
        for r in range(2):
            sd[b + f"mlp.fc{r + 1}.weight"] = get(i, f"{mlp}/Dense_{r}/kernel").T.contiguous()
            sd[b + f"mlp.fc{r + 1}.bias"] = get(i, f"{mlp}/Dense_{r}/bias")
    return sd


def to_jax_npz_arrays(sd: Mapping[str, torch.Tensor], num_heads: int) -> dict[str, np.ndarray]:
    """The inverse of :func:`convert_jax_npz` for a timm-layout state_dict: vision_transformer
    names and Flax shapes (``(D, H, d)`` attention kernels need ``num_heads``).

    Raises:
        ValueError: the state_dict has parts the Flax ViT does not (LayerScale, relative
        position bias, Linformer projections) or no class token (average pooling).
    """
    extra = [k for k in sd if any(s in k for s in ("ls1.", "ls2.", "relative_position", "kernel."))]
    if extra or "cls_token" not in sd:
        raise ValueError(f"the Flax ViT has no counterpart for {extra[:3] or 'average pooling without cls_token'}")

    def n(x: torch.Tensor) -> np.ndarray:
        return x.detach().float().cpu().numpy()

    dim = sd["patch_embed.proj.weight"].shape[0]
    hd = dim // num_heads
    out = {"embedding/kernel": n(sd["patch_embed.proj.weight"].permute(2, 3, 1, 0)),
           "embedding/bias": n(sd["patch_embed.proj.bias"])}
    out["cls"] = n(sd["cls_token"])
    if "pos_embed" in sd:
        out["Transformer/posembed_input/pos_embedding"] = n(sd["pos_embed"])
    out["Transformer/encoder_norm/scale"], out["Transformer/encoder_norm/bias"] = n(sd["norm.weight"]), n(
        sd["norm.bias"])
    if "head.weight" in sd:
        out["head/kernel"], out["head/bias"] = n(sd["head.weight"].T), n(sd["head.bias"])
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(depth):
        b, j = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        mha = j + "MultiHeadDotProductAttention_1/"
        out[j + "LayerNorm_0/scale"], out[j + "LayerNorm_0/bias"] = n(sd[b + "norm1.weight"]), n(sd[b + "norm1.bias"])
        for part, wq, bq in zip(("query", "key", "value"), sd[b + "attn.qkv.weight"].chunk(3),
                                sd[b + "attn.qkv.bias"].chunk(3)):
            out[mha + f"{part}/kernel"] = n(wq.T.reshape(dim, num_heads, hd))
            out[mha + f"{part}/bias"] = n(bq.reshape(num_heads, hd))
        out[mha + "out/kernel"] = n(sd[b + "attn.proj.weight"].T.reshape(num_heads, hd, dim))
        out[mha + "out/bias"] = n(sd[b + "attn.proj.bias"])
        out[j + "LayerNorm_2/scale"], out[j + "LayerNorm_2/bias"] = n(sd[b + "norm2.weight"]), n(sd[b + "norm2.bias"])
        for r in range(2):
            out[j + f"MlpBlock_3/Dense_{r}/kernel"] = n(sd[b + f"mlp.fc{r + 1}.weight"].T)
            out[j + f"MlpBlock_3/Dense_{r}/bias"] = n(sd[b + f"mlp.fc{r + 1}.bias"])
    return out


def save_jax_npz(model: torch.nn.Module, path: str | Path) -> None:
    """Write ``model`` (a :class:`~vitflow.models.vit.model.VisionTransformer`) as a
    vision_transformer-style ``.npz`` (see :func:`to_jax_npz_arrays`)."""
    np.savez(path, **to_jax_npz_arrays(model.state_dict(), model.blocks[0].attn.num_heads))
