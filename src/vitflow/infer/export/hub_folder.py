"""A trained model saved as a hub-style folder, in timm's layout (``vitflow export --format hub``).

::

    DIR/config.json        {"architecture": timm name, "num_classes", "num_features", "global_pool",
                            "model_args": timm constructor arguments, "label_names": [...],
                            "pretrained_cfg": {"input_size": [3, H, W], "mean", "std", "crop_pct",
                            "interpolation", ...}, "vitflow": {"model_args", "task", "threshold", ...}}
    DIR/model.safetensors  the weights with timm's parameter names
    DIR/README.md          the model card: the run's metrics, classes, preprocessing, how to load it

timm reads it with ``timm.create_model("local-dir:DIR", pretrained=True)`` (tested with timm
1.0.31; its ``model_args`` rebuild variants timm has no name for), vitflow with
:func:`read_hub_folder` (and ``vitflow predict DIR ...``, ``vitflow embed DIR ...``,
``vitflow eval DIR --knn K --data PATH``). The layout is
the one timm's ``push_to_hf_hub`` / ``save_for_hf`` writes (``timm/models/_hub.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.config.messages import MESSAGES
from vitflow.data.transforms import Preprocess
from vitflow.infer.export.model_card import model_card
from vitflow.models import create_model, family_of, model_kwargs
from vitflow.models.attention import EXACT_BACKENDS
from vitflow.models.lora import split_lora_args
from vitflow.models.pretrained.timm_args import timm_overrides, vitflow_kwargs

CONFIG_NAME, WEIGHTS_NAME, CARD_NAME = "config.json", "model.safetensors", "README.md"


SWIN_BASE, SWIN_V2_BASE = "swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256"  # timm builds any Swin from these


def is_hub_folder(path: str | Path) -> bool:
    """A folder holding a ``config.json`` (a hub-style model folder or snapshot)."""
    return Path(path).is_dir() and (Path(path) / CONFIG_NAME).is_file()


def _named_family_args(name: str, kw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """:func:`timm_model_args` of a family registered under timm's names (``kw``: the model's
    keyword arguments). Raises ValueError for an MViTv2 timm cannot rebuild."""
    family, arch = family_of(name), name
    if family.name == "swin" and not _timm_knows(name):  # vitflow's own Swin: its structure, explicitly
        arch = SWIN_V2_BASE if name.startswith("swinv2") else SWIN_BASE
    out = {"img_size": kw["img_size"], "num_classes": kw.get("num_classes", 1000)}
    extra = timm_overrides(arch, family.variants[arch], kw)
    if family.name == "mvit":  # timm's MultiScaleVit takes its structure from the name alone
        bad = sorted(set(extra) - {"in_chans", "global_pool"}) or ([] if _timm_knows(name) else ["name"])
        if bad:
            raise ValueError(f"model.{bad[0]}={kw.get(bad[0], name)!r}: timm builds MViTv2 from its own "
                             "variant names only (mvitv2_*) with their structure, so it cannot rebuild this model")
    return arch, {**out, **extra}


def timm_model_args(model_args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(architecture, model_args)`` that make timm build the model a vitflow ``model_args`` names
    (``timm.create_model(architecture, **model_args)``); LoRA arguments are dropped (the weights
    are merged: :func:`vitflow.checkpoint.model_from_checkpoint`).

    ViT family: the full structure (``img_size``, ``patch_size``, ``embed_dim``, ``depth``,
    ``num_heads``, ``mlp_ratio``, ``qkv_bias``, ``class_token``, ``global_pool``, ``init_values``),
    so that variants timm has no name for (``vit_digits_patch2_8``) build too; the architecture is
    the vitflow name when timm knows it (checked when timm is installed). The other families
    (DeiT III, DINOv2, CLIP, SigLIP, BEiT, EVA-02, DINOv3, Swin, MViTv2) are registered under timm's names
    with timm's configurations: the name, ``img_size``, ``num_classes`` and every size that differs
    from the variant (e.g. ``depth``), in timm's argument names
    (:func:`vitflow.models.pretrained.timm_args.timm_overrides`); a Swin variant timm has no name for
    (``swin_cifar_patch2_window4_32``) is :data:`SWIN_BASE` with the sizes that differ from it; an
    MViTv2 only by timm's own name and structure (timm's ``MultiScaleVit`` takes no sizes).

    A ViT with fixed 2-D sin-cos positions (``pos_embed=sincos2d``) is described as timm's plain
    ViT with a learned ``pos_embed``: :func:`hub_tensors` writes the fixed table there, which gives
    the same logits at the trained input size (timm resamples it for another size, as it would a
    learned table; vitflow recomputes the sin-cos table).

    Raises:
        ValueError: a model timm cannot build with these weights (naming the key): pruned blocks,
            relative position bias (ViT) or a position encoding other than the family's own, an
            approximate attention kernel, an option timm's model has no argument for.
    """
    args, _ = split_lora_args(model_args)
    name = args.pop("name")
    kw = model_kwargs(name, **args)
    if family_of(name).name != "vit":
        return _named_family_args(name, kw)
    refusals = {"block_heads": kw.get("block_heads") is not None, "block_mlp_hidden": kw.get("block_mlp_hidden") is not None,
                "attention": kw.get("attention", "sdpa") not in (*EXACT_BACKENDS, "auto")}
    for key, bad in refusals.items():
        if bad:
            raise ValueError(f"model.{key}={kw.get(key)!r}: timm cannot rebuild this model (a hub folder holds "
                             "plain ViT weights: no pruned blocks, exact attention)")
    if kw.get("pos_embed") == "relative":  # the one position encoding a table cannot stand for
        raise ValueError(MESSAGES["hub_relative_positions"].format())
    pool = kw.get("global_pool") or "token"
    out = {"img_size": kw["img_size"], "patch_size": kw["patch_size"], "embed_dim": kw["embed_dim"],
           "depth": kw["depth"], "num_heads": kw["num_heads"], "mlp_ratio": kw.get("mlp_ratio") or 4.0,
           "qkv_bias": kw.get("qkv_bias", True), "num_classes": kw.get("num_classes", 1000)}
    if kw.get("in_chans", 3) != 3:
        out["in_chans"] = kw["in_chans"]
    if kw.get("layer_scale_init"):
        out["init_values"] = kw["layer_scale_init"]
    if kw.get("distilled"):
        return (name if _timm_knows(name) else "deit_base_distilled_patch16_224"), out
    out.update(class_token=pool == "token", global_pool=pool)
    return (name if _timm_knows(name) else "vit_base_patch16_224"), out


def _timm_knows(name: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return timm.is_model(name)


def hub_config(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """``config.json`` of a checkpoint ``state`` (see the module docstring)."""
    arch, targs = timm_model_args(state["model_args"])
    pp = Preprocess.from_dict(state["preprocess"])
    pool = targs.get("global_pool", getattr(model, "global_pool", "token"))
    cfg = {"input_size": [targs.get("in_chans", 3), pp.image_size, pp.image_size], "mean": list(pp.mean),
           "std": list(pp.std), "crop_pct": pp.crop_pct, "interpolation": pp.interpolation, "fixed_input_size": True,
           "first_conv": "patch_embed.proj", "num_classes": targs["num_classes"],
           "classifier": ["head", "head_dist"] if hasattr(model, "head_dist") else "head"}
    return {"architecture": arch, "num_classes": targs["num_classes"], "num_features": int(model.embed_dim),
            "global_pool": pool, "model_args": targs, "label_names": list(state["classes"]),
            "pretrained_cfg": cfg,
            "vitflow": {"model_args": split_lora_args(state["model_args"])[0], "task": state.get("task", "multiclass"),
                        "threshold": state.get("threshold"), "step": state.get("step")}}


def save_hub_folder(checkpoint: str | Path, out: str | Path, weights: str = "auto") -> dict[str, Any]:
    """Write a checkpoint (or a run directory's newest) as a hub-style folder ``out``.

    The folder is written as a hidden ``.NAME.partial`` beside ``out`` and renamed when complete;
    it is then read back with :func:`read_hub_folder` and its logits compared with the
    checkpoint's model on one random batch (``max_abs_diff``).

    Args:
        weights: ``auto`` (the EMA weights when saved), ``ema`` or ``raw``.
    Returns:
        ``{"path", "architecture", "files": [names], "bytes", "max_abs_diff", "classes": count}``.
    Raises:
        ValueError: ``out`` exists and is not an empty folder (never overwritten); an INT8
            checkpoint; a model timm cannot rebuild (:func:`timm_model_args`).
        FileNotFoundError: no checkpoint.
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: choose a new folder for the model "
                         "(an existing one is never overwritten)")
    state = load_checkpoint(checkpoint)
    if state.get("quantization"):
        raise ValueError(f"{state['path']} is an INT8 checkpoint: save the float checkpoint as a hub folder")
    model = model_from_checkpoint(state, weights).float()
    config = hub_config(state, model)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(hub_tensors(model), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / CARD_NAME).write_text(model_card(state, config, out.name, _run_eval(state)))
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reloaded = read_hub_folder(out).model
    x = torch.randn(2, config["pretrained_cfg"]["input_size"][0], *config["pretrained_cfg"]["input_size"][1:])
    with torch.no_grad():
        diff = float((reloaded(x) - model(x)).abs().max())
    files = sorted(p.name for p in out.iterdir())
    return {"path": str(out), "architecture": config["architecture"], "files": files, "max_abs_diff": diff,
            "bytes": sum((out / f).stat().st_size for f in files), "classes": len(config["label_names"]),
            "checkpoint": state["path"], "step": state.get("step")}


def hub_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a hub folder holds: the model's state_dict (contiguous copies) plus, for fixed
    sin-cos positions (a buffer no state_dict keeps), the table itself as ``pos_embed``
    ``float32 (1, prefix + h*w, dim)``, which timm loads as its learned position embedding."""
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if getattr(model, "pos_embed_type", None) == "sincos2d" and "pos_embed" not in tensors:
        tensors["pos_embed"] = model.pos_embed.detach().float().contiguous().clone()
    return tensors


def _run_eval(state: dict[str, Any]) -> dict[str, Any] | None:
    """The run's final evaluation (``RUN/eval.json``) when it belongs to this checkpoint's step."""
    path = Path(state["path"]).parent.parent / "eval.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if found.get("step") == state.get("step") else None


@dataclass
class HubModel:
    """A model read from a hub-style folder: ``model`` (eval mode, CPU), its ``preprocess``, the
    class names of its head (``None`` when unknown), its vitflow ``name``, and for vitflow's own
    folders the ``task`` and multi-label ``threshold``."""

    model: torch.nn.Module
    preprocess: Preprocess
    classes: list[str] | None
    name: str
    task: str = "multiclass"
    threshold: float | None = None


def vitflow_model_args(architecture: str, model_args: dict[str, Any]) -> dict[str, Any]:
    """:func:`vitflow.create_model` arguments (without ``num_classes``) for a timm ``config.json``'s
    ``architecture`` and ``model_args`` (the inverse of :func:`timm_model_args`: timm's
    ``init_values`` is vitflow's ``layer_scale_init``; :func:`vitflow.models.pretrained.timm_args.vitflow_kwargs`).

    Raises:
        ValueError: an unknown architecture, or a timm argument vitflow has no equivalent for
            (named).
    """
    family_of(architecture)  # an unknown name raises, naming the closest
    args = vitflow_kwargs(model_args, f"config.json of {architecture}")
    args.pop("num_classes", None)
    return args


def read_hub_folder(folder: str | Path) -> HubModel:
    """Load a hub-style folder (see the module docstring).

    A folder written by vitflow is rebuilt exactly from its ``vitflow.model_args``; a timm folder
    without that key from its ``architecture`` (a vitflow model of that name) and ``model_args``
    (:func:`vitflow_model_args`), with its head when ``label_names`` fit ``num_classes``. The
    preprocessing is ``pretrained_cfg``'s.

    Raises:
        FileNotFoundError: no ``config.json`` or no ``model.safetensors``.
        ValueError: unreadable config, or weights that do not fit (naming the folder).
    """
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
        cfg = config.get("pretrained_cfg") or config
        size = cfg["input_size"][-1]
        pp = Preprocess(int(size), float(cfg.get("crop_pct", 0.875)), str(cfg.get("interpolation", "bicubic")),
                        tuple(cfg.get("mean", (0.485, 0.456, 0.406))), tuple(cfg.get("std", (0.229, 0.224, 0.225))))
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder / CONFIG_NAME}: no such file (a model folder holds config.json and "
                                f"{WEIGHTS_NAME})") from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{folder / CONFIG_NAME}: not a model config ({type(e).__name__}: {e})") from None
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: no {WEIGHTS_NAME} beside {CONFIG_NAME}")
    labels = list(config.get("label_names") or []) or None
    own = config.get("vitflow") or {}
    if own.get("model_args") is None:
        name = config["architecture"]
        classes = config.get("num_classes", 0)
        labels = labels if labels and len(labels) == classes else None
        model = create_model(name, pretrained=str(weights), num_classes=classes if labels else 0,
                             **vitflow_model_args(name, config.get("model_args") or {}))
        return HubModel(model.eval(), pp, labels, name)
    from safetensors.torch import load_file

    args = dict(own["model_args"])
    name = args.pop("name")
    model = create_model(name, **args)
    sd = load_file(str(weights))
    if "pos_embed" in sd and "pos_embed" not in model.state_dict():  # the sin-cos table written for timm
        sd.pop("pos_embed")
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not fit {CONFIG_NAME}'s model: {str(e).splitlines()[0]}") from None
    return HubModel(model.eval(), pp, labels, name, own.get("task", "multiclass"), own.get("threshold"))
