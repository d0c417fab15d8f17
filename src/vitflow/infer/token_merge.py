"""How many tokens to merge: the accuracy guard of token merging (ToMe,
:mod:`vitflow.models.token_merging`). Top-1 (multi-label: mAP) of the checkpoint's model on real
images with no merging, then with more and more tokens merged per block; the largest ``r`` whose
figure stays within ``max_drop`` points is chosen (``vitflow bench infer --token-merge auto``,
``vitflow merge-tokens``). Merging is applied to the trained weights as they are: no fine-tuning.

:func:`merge_checkpoint` writes the checkpoint with the chosen ``r`` in its ``model_args``: every
command then runs the merged model (``predict``, ``export``, ``quantize``, ``serve``, ``bench infer``),
so token merging combines with INT8 and with pruning."""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from vitflow.data import ImageSource
from vitflow.infer.bench.timing import speedups
from vitflow.infer.calibration import accuracy, checkpoint_split
from vitflow.infer.quantize.dynamic import inference_state
from vitflow.infer.runtimes.onnx import ModelInfo
from vitflow.metrics import primary_metric
from vitflow.models.token_merging import check_mergeable, default_merge, merge_schedule


def merge_candidates(num_patches: int, depth: int) -> list[int]:
    """The ``r`` values the guard tries, ascending: fractions and multiples of
    :func:`~vitflow.models.token_merging.default_merge` (1/4 to 3x), each at least 1 and at most
    what the first block can merge (half the patches)."""
    d = default_merge(num_patches, depth)
    return sorted({min(num_patches // 2, max(1, round(d * f))) for f in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3)})


def choose_token_merge(model: torch.nn.Module, source: ImageSource, info: ModelInfo, max_drop: float = 1.0,
                       candidates: list[int] | None = None, log: Callable[[str], None] = print) -> dict:
    """The largest ``r`` within ``max_drop`` points of the unmerged model on ``source``.

    Candidates are measured in ascending order and the search stops at the first one that loses
    more than ``max_drop`` points (merging more only loses more, up to noise).

    Args:
        model: a float ViT (eval mode; not changed: a copy merges).
        source: labelled images (:func:`vitflow.infer.quantize.guard.guard_source`).
        candidates: ``r`` values (default :func:`merge_candidates`).
    Returns:
        ``{"r": chosen (0: none within the drop), "figure": "top1" or "map", "before": fraction,
        "curve": [{"r", "value", "drop_points", "seconds"}], "images", "max_drop"}``.
    Raises:
        ValueError: a model that cannot merge (:func:`~vitflow.models.token_merging.check_mergeable`).
    """
    check_mergeable(model)
    merged = copy.deepcopy(model).eval()
    figure = primary_metric(info.task).name
    candidates = candidates or merge_candidates(model.grid_size**2, len(model.blocks))
    before = accuracy(model, source, info.preprocess, threshold=info.threshold)
    log(f"token merging guard: r=0 {figure} {before[figure]:.2%} on {before['images']} images")
    curve, chosen = [], 0
    for r in candidates:
        merged.set_token_merge(r)
        t0 = time.perf_counter()
        value = accuracy(merged, source, info.preprocess, threshold=info.threshold)[figure]
        drop = (before[figure] - value) * 100
        curve.append({"r": r, "value": value, "drop_points": round(drop, 3),
                      "seconds": round(time.perf_counter() - t0, 2)})
        log(f"token merging guard: r={r} {figure} {value:.2%} (drop {drop:.2f} points)")
        if drop > max_drop:
            break
        chosen = r
    return {"r": chosen, "figure": figure, "before": before[figure], "curve": curve, "images": before["images"],
            "max_drop": max_drop}


def merge_checkpoint(checkpoint, out, r: int | str = "auto", max_drop: float = 1.0, data: str | None = None,
                     split: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Write ``checkpoint`` with token merging: ``r`` tokens merged per block, or (``"auto"``) the
    largest within ``max_drop`` points on the checkpoint's test data (``data`` / ``split`` to
    measure elsewhere; :func:`choose_token_merge`).

    Returns:
        ``{"path", "r", "schedule" (per block, as capped), "figure", "before", "after", "drop_points", "images", "curve",
        "speedup_throughput", "speedup_latency", "timing"}`` (fp32 eager speed-ups, timed side by side).
    Raises:
        FileNotFoundError / ValueError / DataError: unreadable checkpoint or data, an output not
        named ``.pt``, a quantized checkpoint or a model that cannot merge, ``r="auto"`` finding no
        ``r`` within ``max_drop`` (nothing written).
    """
    if not str(out).endswith(".pt"):
        raise ValueError(f"-o {out}: the merged checkpoint is a .pt file")
    state = load_checkpoint(checkpoint)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is quantized; merge tokens in the float checkpoint, then quantize")
    model, info = model_from_checkpoint(state).float().eval(), ModelInfo.from_checkpoint(state)
    if getattr(model, "token_merge", 0):
        log(f"{state['path']} already merges tokens (r={model.token_merge}); measuring from the unmerged model")
        model.set_token_merge(0)
    source = checkpoint_split(state, data, split)
    if r == "auto":
        choice = choose_token_merge(model, source, info, max_drop, log=log)
        if not choice["r"]:
            raise ValueError(f"no token merging keeps {choice['figure']} within {max_drop:g} points "
                             f"(r={choice['curve'][0]['r']} lost {choice['curve'][0]['drop_points']:.2f}); {out} NOT "
                             "written (raise --max-drop, or give -r)")
    else:
        choice = choose_token_merge(model, source, info, float("inf"), [int(r)], log=log)
    merged = copy.deepcopy(model)
    schedule = merge_schedule(choice["r"], len(model.blocks), model.grid_size**2)
    if any(v != choice["r"] for v in schedule):
        log(f"r={choice['r']} is capped where a block has fewer tokens to merge: {schedule} per block")
    merged.set_token_merge(schedule if len(set(schedule)) > 1 else choice["r"])
    after = next(c for c in choice["curve"] if c["r"] == choice["r"])
    result = {"path": str(out), "r": choice["r"], "schedule": schedule, "figure": choice["figure"], "before": choice["before"],
              "after": after["value"], "drop_points": after["drop_points"], "images": choice["images"],
              "curve": choice["curve"], **speedups({"unmerged": model, "merged": merged}, info.preprocess.image_size)}
    save_checkpoint({**inference_state(state), "model": merged.state_dict(),
                     "model_args": {**state["model_args"], "token_merge": merged.token_merge},
                     "metrics": {choice["figure"]: after["value"]},
                     "token_merging": {k: v for k, v in result.items() if k != "path"}}, out)
    return result
