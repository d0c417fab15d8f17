"""Fit Swin / Swin V2 weights (timm's names) to a model of another window or input size at load time.

* V1 (Liu et al. 2021): each block's ``attn.relative_position_bias_table`` ``((2W-1)^2, heads)``
  is learned per offset; for another window ``W'`` it is resampled to ``((2W'-1)^2, heads)`` as
  timm's ``checkpoint_filter_fn`` does (``resize_rel_pos_bias_table``, from BEiT / unilm):
  the source offsets are spread over the target range with a geometric progression (small
  offsets keep their spacing, large ones stretch) and read off by piecewise-linear
  interpolation. ``mode="bicubic"`` instead resizes the offset plane bicubically
  (:func:`vitflow.models.position.resample_relative_table`). One log line per change, e.g.
  ``relative_position_bias_table: window 7 -> 8 (resampled) in 4 blocks``.
* V2 (Liu et al. 2022): the bias comes from a small MLP over log-spaced continuous coordinates
  (``attn.cpb_mlp``), so there is no table to resample; the model's ``pretrained_window_sizes``
  (timm's ``swinv2_*_window12to16_192to256``) scale the coordinates as in pre-training. Logged.
* Buffers rebuilt from the window (``relative_position_index``, ``relative_coords_table``,
  ``attn_mask``, V2's zero ``k_bias``) are dropped from the file.
* The original Microsoft layout (patch merging at the end of a stage: ``layers.0.downsample``,
  ``head.weight``) is moved to timm's (``layers.1.downsample``, ``head.fc.weight``), and a head of
  another class count is dropped (``head reset: 1000 -> 5 classes``).

:func:`adapt_swin_state_dict` is what :func:`vitflow.models.pretrained.weights.adapt_state_dict` calls for a
Swin model (:func:`is_swin_model`).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from typing import Mapping

import torch
import torch.nn as nn

from vitflow.models.position import resample_relative_table

log = logging.getLogger(__name__)

_TABLE = ".relative_position_bias_table"
_SWIN_KEY = re.compile(r"^layers\.\d+\.blocks\.\d+\.attn\.(relative_position_bias_table|cpb_mlp\.)")
_REBUILT = re.compile(r"(relative_position_index|relative_coords_table|attn_mask|attn\.k_bias)$")


def is_swin_model(model: nn.Module) -> bool:
    """True for a Swin / Swin V2 with timm's names (a ``layers.{i}.blocks.{j}.attn`` with a
    relative position table or a continuous-bias MLP)."""
    return any(_SWIN_KEY.match(k) for k in model.state_dict())


def geometric_offsets(src: int, dst: int) -> torch.Tensor:
    """Where the ``src`` (odd) offsets of a relative table sit on the ``dst``-wide target axis
    (BEiT / timm): ``0, +-1, +-(1+q), +-(1+q+q^2), ...`` with ``q`` in [1.01, 1.5] chosen by
    bisection so the largest offset stays within ``dst // 2``. float64 ``(src,)``, ascending."""
    def reach(q: float) -> float:  # 1 + q + ... + q^(n-1): the largest offset for ratio q
        return (1.0 - q ** (src // 2)) / (1.0 - q)

    lo, hi = 1.01, 1.5
    while hi - lo > 1e-6:
        q = (lo + hi) / 2.0
        lo, hi = (lo, q) if reach(q) > dst // 2 else (q, hi)
    steps, cur = [], 1.0
    for i in range(src // 2):
        steps.append(cur)
        cur += q ** (i + 1)
    return torch.tensor([-s for s in reversed(steps)] + [0.0] + steps, dtype=torch.float64)


def _linear_weights(points: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(len(targets), len(points))`` piecewise-linear interpolation weights from sorted
    ``points`` to ``targets``, constant beyond the ends (as timm's ``RegularGridInterpolator``)."""
    t = targets.clamp(points[0], points[-1])
    right = torch.searchsorted(points, t).clamp(1, len(points) - 1)
    left = right - 1
    frac = (t - points[left]) / (points[right] - points[left])
    w = torch.zeros(len(targets), len(points), dtype=torch.float64)
    rows = torch.arange(len(targets))
    w[rows, left] += 1 - frac
    w[rows, right] += frac
    return w


def resample_swin_table(table: torch.Tensor, new_window: tuple[int, int], old_window: tuple[int, int] | None = None,
                        mode: str = "timm") -> torch.Tensor:
    """A Swin V1 relative position bias table for another window.

    Args:
        table: ``((2h-1)(2w-1), heads)``, any float dtype.
        new_window: ``(h', w')`` in tokens. old_window: ``(h, w)``; None = square from the rows.
        mode: ``"timm"`` (geometric offsets + linear interpolation, equal to timm's
            ``resize_rel_pos_bias_table`` to float32 rounding) or ``"bicubic"``.
    Returns:
        ``((2h'-1)(2w'-1), heads)`` in ``table``'s dtype (``table`` itself for the same window).
    Raises:
        ValueError: a table whose rows are not ``(2h-1)(2w-1)`` of a window, or an unknown mode.
    """
    rows, heads = table.shape
    if old_window is None:
        side = math.isqrt(rows)
        if side * side != rows or side % 2 == 0:
            raise ValueError(f"relative_position_bias_table of {rows} rows is not (2W-1)^2 of a square window")
        old_window = ((side + 1) // 2,) * 2
    src = (2 * old_window[0] - 1, 2 * old_window[1] - 1)
    dst = (2 * new_window[0] - 1, 2 * new_window[1] - 1)
    if src[0] * src[1] != rows:
        raise ValueError(f"relative_position_bias_table of {rows} rows does not fit window {tuple(old_window)}")
    if src == dst:
        return table
    if mode == "bicubic":
        return resample_relative_table(table, tuple(old_window), tuple(new_window), num_prefix_tokens=0)
    if mode != "timm":
        raise ValueError(f"unknown table resampling mode {mode!r} (timm or bicubic)")
    wy = _linear_weights(geometric_offsets(src[0], dst[0]), torch.arange(dst[0], dtype=torch.float64) - dst[0] // 2)
    wx = _linear_weights(geometric_offsets(src[1], dst[1]), torch.arange(dst[1], dtype=torch.float64) - dst[1] // 2)
    plane = table.detach().to(torch.float64).T.reshape(heads, src[0], src[1])
    out = torch.einsum("ys,hst,xt->hyx", wy, plane.cpu(), wx)
    return out.reshape(heads, -1).T.contiguous().to(device=table.device, dtype=table.dtype)


def _window_of(model: nn.Module, module_name: str, own_rows: int) -> tuple[int, int]:
    """The attention window of ``module_name`` (its ``window_size``, else square from the table rows)."""
    try:
        size = getattr(model.get_submodule(module_name), "window_size", None)
    except AttributeError:
        size = None
    if size is not None:
        return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))
    side = (math.isqrt(own_rows) + 1) // 2
    return side, side


def _from_original_layout(sd: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Microsoft's layout (``layers.{i}.downsample`` at a stage's end, ``head.weight``) in timm's."""
    if "layers.0.downsample.reduction.weight" not in sd or "layers.0.downsample.reduction.weight" in own:
        return sd
    log.info("Swin weights in the original layout: patch merging moved to the start of the next stage, "
             "head -> head.fc")
    out = {}
    for k, v in sd.items():
        k = re.sub(r"^layers\.(\d+)\.downsample\.", lambda m: f"layers.{int(m[1]) + 1}.downsample.", k)
        out[re.sub(r"^head\.(weight|bias)$", r"head.fc.\1", k)] = v
    return out


def adapt_swin_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module,
                          mode: str = "timm") -> dict[str, torch.Tensor]:
    """Fit a Swin / Swin V2 state_dict in timm's names to ``model`` (its window and input size).

    Resamples V1 relative position tables to the model's windows (:func:`resample_swin_table`,
    ``mode`` as there), drops buffers the model rebuilds, moves the original Microsoft layout to
    timm's, and drops a head of another class count. Logs each change. V2 needs no resampling.

    Returns:
        a new dict (the input is not modified).
    Raises:
        ValueError: a relative position table of no square window (naming the key).
    """
    own = model.state_dict()
    sd = _from_original_layout(dict(state_dict), own)
    file_windows = {k[:-len(".relative_coords_table")]: (v.shape[-3] + 1) // 2 for k, v in sd.items()
                    if k.endswith(".relative_coords_table") and v.dim() == 4}
    sd = {k: v for k, v in sd.items() if not _REBUILT.search(k)}
    changes: Counter = Counter()
    for key in [k for k in sd if k.endswith(_TABLE) and k in own]:
        old = sd[key]
        if old.shape == own[key].shape:  # the same window
            continue
        new_window = _window_of(model, key[:-len(_TABLE)], own[key].shape[0])
        try:
            sd[key] = resample_swin_table(old, new_window, mode=mode)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        changes[((math.isqrt(old.shape[0]) + 1) // 2, new_window)] += 1
    for (old_w, new_w), n in sorted(changes.items()):
        new = new_w[0] if new_w[0] == new_w[1] else f"{new_w[0]}x{new_w[1]}"
        log.info("relative_position_bias_table: window %d -> %s (resampled%s) in %d blocks", old_w, new,
                 "" if mode == "timm" else f", {mode}", n)
    _log_v2(model, file_windows)
    head = sd.get("head.fc.weight")
    if head is not None and (own.get("head.fc.weight") is None or head.shape != own["head.fc.weight"].shape):
        log.info("head reset: %d -> %d classes", head.shape[0], getattr(model, "num_classes", 0))
        sd = {k: v for k, v in sd.items() if not k.startswith("head.fc.")}
    return sd


def _log_v2(model: nn.Module, file_windows: dict[str, int]) -> None:
    """One line on a Swin V2's windows: nothing to resample (continuous bias); where the file's
    ``relative_coords_table`` tells its window, the change is named."""
    attns = [(n, m) for n, m in model.named_modules() if n.endswith(".attn") and hasattr(m, "cpb_mlp")]
    if not attns:
        return

    def side(m: nn.Module, name: str) -> int:
        size = getattr(m, name, 0)
        return int(size if isinstance(size, int) else size[0])

    windows = sorted({side(m, "window_size") for _, m in attns})
    pretrained = sorted({side(m, "pretrained_window_size") for _, m in attns})
    changed = sorted({(w, side(m, "window_size")) for n, m in attns
                      if (w := file_windows.get(n)) and w != side(m, "window_size")})
    what = "; ".join(f"window {a} -> {b}" for a, b in changed) or "windows " + ", ".join(str(w) for w in windows)
    log.info("Swin V2 %s: continuous position bias (cpb_mlp), nothing to resample; pretrained_window_sizes %s",
             what, ", ".join(str(p) for p in pretrained))
