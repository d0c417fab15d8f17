"""The Swin family: named variants of :class:`~vitflow.models.swin.model.SwinTransformer` with timm's
names and configurations; its ``model`` section is :class:`vitflow.config.SwinConfig`.

- Swin (Liu et al. 2021, table 1): T / S / B / L, patch 4, window 7 at 224 px, window 12 at 384;
- Swin V2 (Liu et al. 2022): timm's ``swinv2_*`` (window 8 / 16 at 256 px, window 12 at 192,
  the ``12to16`` / ``12to24`` fine-tunes with V2's pretrained window sizes);
- ``swin_cifar_patch2_window4_32``: 32x32 inputs (CIFAR), patch 2 (a 16x16 grid), window 4,
  width 96, depths (2, 2, 2) over three stages (16x16, 8x8, 4x4 grids);
- ``swin_compact_patch4_window4_64``: the same for 64-px photos on a CPU (the plan's race), patch 4
  (the same grids).

Depths and heads are per stage in a Swin: ``model.depths`` / ``model.num_heads`` take one number
per stage (``model.depths=2,2,6,2``), as :func:`vitflow.create_model`'s ``depths`` / ``num_heads``.
"""

from __future__ import annotations

import inspect
from typing import Any

from vitflow.config import ConfigError, SwinConfig
from vitflow.models.family import ModelFamily, constructor
from vitflow.models.pretrained.weights import load_pretrained
from vitflow.models.swin.model import SwinTransformer

_SIZES = {  # name: (embed_dim, depths, num_heads)
    "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)),
    "large": (192, (2, 2, 18, 2), (6, 12, 24, 48)),
}
# what build takes beyond the config's keys: SwinTransformer's other arguments (in_chans, version, ...)
_ARGUMENTS = frozenset(inspect.signature(SwinTransformer).parameters)


def _v1(size: str, img: int, window: int) -> dict[str, Any]:
    dim, depths, heads = _SIZES[size]
    return dict(img_size=img, patch_size=4, window_size=window, embed_dim=dim, depths=depths, num_heads=heads)


def _variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for size in ("tiny", "small", "base", "large"):
        out[f"swin_{size}_patch4_window7_224"] = _v1(size, 224, 7)
    for size in ("base", "large"):
        out[f"swin_{size}_patch4_window12_384"] = _v1(size, 384, 12)
    v2 = dict(patch_size=4, version=2)
    for size in ("tiny", "small", "base"):
        for window in (8, 16):
            out[f"swinv2_{size}_window{window}_256"] = dict(_v1(size, 256, window), **v2)
    for size in ("base", "large"):
        out[f"swinv2_{size}_window12_192"] = dict(_v1(size, 192, 12), **v2)
        for window, img in ((16, 256), (24, 384)):
            out[f"swinv2_{size}_window12to{window}_192to{img}"] = dict(
                _v1(size, img, window), pretrained_window_sizes=(12, 12, 12, 6), **v2)
    # 32x32 inputs (CIFAR): patch 2 -> 16x16, 8x8, 4x4 grids; window 4 shifts in every stage
    out["swin_cifar_patch2_window4_32"] = dict(img_size=32, patch_size=2, window_size=4, embed_dim=96,
                                               depths=(2, 2, 2), num_heads=(3, 6, 12), mlp_ratio=2.0)
    # the same for 64-px photos on a CPU (the plan's race): patch 4 -> the same 16x16, 8x8, 4x4 grids
    out["swin_compact_patch4_window4_64"] = dict(out["swin_cifar_patch2_window4_32"], img_size=64, patch_size=4)
    return out


build = constructor(SwinTransformer)  # a Swin from its variant's arguments and SwinConfig's keys


def summary(args: dict[str, Any]) -> str:
    """A short ``vitflow models`` column for a variant."""
    depths = "-".join(str(d) for d in args["depths"])
    return (f"img {args['img_size']:>3}  patch {args['patch_size']:>2}  dim {args['embed_dim']:>4}  "
            f"depths {depths}  window {args['window_size']}" + ("  V2" if args.get("version") == 2 else ""))


def check_swin_config(m: SwinConfig) -> None:
    """``model.depths`` and ``model.num_heads`` name the same number of stages (either may be
    the variant's).

    Raises:
        ConfigError: naming the key that differs from the other's stages.
    """
    variant = SWIN.variants[m.name]
    depths, heads = m.depths or variant["depths"], m.num_heads or variant["num_heads"]
    if len(depths) != len(heads):
        key = "model.num_heads" if m.num_heads else "model.depths"
        raise ConfigError(f"{key}={list(getattr(m, key[6:]))} is invalid: {m.name} with depths {list(depths)} and "
                          f"heads {list(heads)} would name {len(depths)} and {len(heads)} stages (give both)", key)


SWIN = ModelFamily("swin", "Swin Transformer (Liu et al. 2021) and Swin V2 (Liu et al. 2022): shifted windows",
                   _variants(), build, load_pretrained, summary, config=SwinConfig, arguments=_ARGUMENTS,
                   check_config=check_swin_config)
