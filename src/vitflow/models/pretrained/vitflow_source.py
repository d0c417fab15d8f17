"""vitflow's own weights as ``model.pretrained``: a run folder, a checkpoint, or a hub folder that
``vitflow export --format hub`` wrote. Each knows its architecture exactly (the ``model_args`` a
checkpoint keeps, the ``vitflow.model_args`` of a hub folder's ``config.json``), its preprocessing
and its class names, so :func:`vitflow.models.pretrained.hub.resolve_pretrained` returns them all
and ``model.name=auto`` needs nothing copied by hand.

The files are read without running code from them (``torch.load(weights_only=True)``, memory-mapped:
only the small entries are touched here; the weights are read by the loader).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vitflow.rundir import run_checkpoint

# model_args keys that choose kernels or training behaviour, not the function the weights compute
RUNTIME_ARGS = ("drop_rate", "drop_path_rate", "patch_drop_rate", "token_merge", "weight_init", "grad_checkpointing",
                "grad_checkpointing_budget", "cpu_bf16_matmul", "attention", "attn_block_size", "attn_window",
                "linformer_k", "performer_features", "pretrained", "lora")


def architecture(model_args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(model name, constructor keys)`` of a vitflow ``model_args`` (a checkpoint's, or a hub
    folder's ``vitflow.model_args``): every key that shapes the weights or what they compute
    (sizes, ``img_size``, ``patch_size``, ``pos_embed``, ``global_pool``, ``num_classes`` ...),
    without the run-time ones (:data:`RUNTIME_ARGS`: dropout, kernels, checkpointing, LoRA)."""
    args = {k: v for k, v in model_args.items() if k not in RUNTIME_ARGS and v is not None}
    return str(args.pop("name")), args


def preprocess_of(pp: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``preprocess`` (``image_size``, ``crop_pct``, ``interpolation``, ``mean``,
    ``std``) in the resolver's names (``input_size`` for ``image_size``)."""
    out = {k: pp[k] for k in ("crop_pct", "interpolation", "mean", "std") if k in pp}
    if "image_size" in pp:
        out["input_size"] = int(pp["image_size"])
    return out


def read_checkpoint_meta(path: Path) -> dict[str, Any] | None:
    """The entries of a vitflow checkpoint file other than the weights and optimizer state
    (``model_args``, ``preprocess``, ``classes``, ``step``, ``config``), or ``None`` when ``path``
    is not one (plain weights, another format, or unreadable: the weights reader then says why)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip-format torch file, pickled code ...: the weights reader says why, later
        return None
    if not isinstance(state, dict) or not isinstance(state.get("model_args"), dict) or "model" not in state:
        return None
    return {k: state.get(k) for k in ("model_args", "preprocess", "classes", "step", "config")}


def from_checkpoint(path: Path) -> dict[str, Any] | None:
    """What a vitflow checkpoint file names: ``{"model_name", "model_kwargs", "preprocess",
    "label_names", "origin", "config"}`` (``config``: the run's whole config as a dict, or ``None``),
    or ``None`` when ``path`` is not a vitflow checkpoint."""
    meta = read_checkpoint_meta(path)
    if meta is None:
        return None
    name, kwargs = architecture(meta["model_args"])
    return {"weights": path, "model_name": name, "model_kwargs": kwargs,
            "preprocess": preprocess_of(meta.get("preprocess") or {}), "label_names": meta.get("classes"),
            "origin": f"vitflow checkpoint {path} (step {meta.get('step')})", "config": meta.get("config")}


def from_run(folder: Path) -> dict[str, Any] | None:
    """:func:`from_checkpoint` of the checkpoint a run folder stands for (its ``best.pt``, else its
    newest), or ``None`` when ``folder`` holds no checkpoint."""
    found = run_checkpoint(folder)
    if found is None:
        return None
    out = from_checkpoint(found)
    if out is not None:
        out["origin"] = f"vitflow run {folder} ({found.name}, {out['origin'].rsplit('(', 1)[-1]}"
    return out


def from_hub_config(config: dict[str, Any], weights: Path, folder: Path) -> dict[str, Any] | None:
    """What a hub folder's ``config.json`` written by vitflow names (its ``vitflow.model_args``,
    exact), or ``None`` for a foreign folder."""
    own = config.get("vitflow") or {}
    if not isinstance(own.get("model_args"), dict):
        return None
    name, kwargs = architecture(own["model_args"])
    cfg = config.get("pretrained_cfg") or {}
    pp = {k: cfg[k] for k in ("crop_pct", "interpolation", "mean", "std") if k in cfg}
    if cfg.get("input_size"):
        pp["input_size"] = int(cfg["input_size"][-1])
    return {"weights": weights, "model_name": name, "model_kwargs": kwargs, "preprocess": pp,
            "label_names": config.get("label_names"), "origin": f"vitflow hub folder {folder} (step {own.get('step')})"}
