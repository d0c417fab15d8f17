"""Where pretrained weights come from: a file, a hub snapshot folder, or ``hf-hub:ORG/NAME[@rev]``.

:func:`resolve_pretrained` turns ``model.pretrained`` into a :class:`Pretrained`: the weights
file, the architecture its config names (a vitflow / timm model name plus constructor keys), the
preprocessing the weights were trained with and the class names. It reads only JSON and never
runs code; the weights themselves are read by :func:`vitflow.models.pretrained.weights.read_state_dict`
(safetensors, or ``torch.load(weights_only=True)``).

Configs read from a snapshot folder (``huggingface_hub``'s cache layout
``models--ORG--NAME/snapshots/REV/`` or any folder):

* timm's ``config.json``: ``architecture``, ``num_classes``, ``pretrained_cfg`` (``input_size``,
  ``mean``, ``std``, ``crop_pct``, ``interpolation``), ``label_names``, and ``model_args`` (sizes
  given to timm beside the name, :func:`vitflow.models.pretrained.timm_args.vitflow_kwargs`; ``vitflow export
  --format hub`` writes e.g. ``depth`` there);
* transformers' ``config.json`` (``model_type``: vit, dinov2, dinov2_with_registers, dinov3_vit,
  clip, clip_vision_model, siglip, siglip_vision_model, beit; swin, swinv2 through
  :func:`vitflow.models.convert.hf_swin.hf_swin_model_args`) -> the timm name of that width
  and the sizes as constructor keys, plus ``preprocessor_config.json`` (``image_mean``,
  ``image_std``, ``size``, ``crop_size``, ``resample``);
* OpenCLIP's ``open_clip_config.json`` (``model_cfg.vision_cfg``, ``preprocess_cfg``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitflow.config.messages import MESSAGES
from vitflow.models.convert.hf_swin import HF_SWIN_TYPES, hf_swin_label_names, hf_swin_model_args
from vitflow.models.pretrained import vitflow_source
from vitflow.models.pretrained.timm_args import vitflow_kwargs
from vitflow.rundir import CHECKPOINTS, RUN

log = logging.getLogger(__name__)

HUB_PREFIX = "hf-hub:"
WEIGHT_FILES = ("model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin",
                "open_clip_pytorch_model.bin", "model.pth", "model.pt")
_HUB_PATTERNS = ["*.json", "model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin",
                 "open_clip_pytorch_model.bin"]
_WIDTHS = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1280: "huge", 1536: "giant"}
_PIL_FILTERS = {2: "bilinear", 3: "bicubic"}


@dataclass
class Pretrained:
    """Resolved ``model.pretrained``.

    Attributes:
        weights: the weights file (``.safetensors``, ``.bin``, ``.pth``, ``.pt`` or ``.npz``).
        model_name: the vitflow / timm model name the snapshot's config names, or None.
        model_kwargs: constructor keys of the weights (``img_size``, ``num_classes``, sizes).
        preprocess: ``{"mean", "std", "input_size", "crop_pct", "interpolation"}`` of the weights
            (any subset), or None.
        label_names: the class names of the weights' head, or None.
        source: the spec as given (for messages).
        config: the whole run config a vitflow checkpoint keeps (a dict), or None.
    """

    weights: Path
    model_name: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    preprocess: dict[str, Any] | None = None
    label_names: list[str] | None = None
    source: str = ""
    origin: str = ""  # what the source is, for messages: "vitflow run RUN (best.pt, step 1200)" ...
    config: dict[str, Any] | None = None  # a vitflow run's or checkpoint's whole config (its preset, data, ...)

    @property
    def vitflow(self) -> bool:
        """Weights vitflow trained (a run, checkpoint or hub folder of its own): the architecture is exact."""
        return self.origin.startswith("vitflow ")


def resolve_pretrained(spec: str | Path, local_only: bool = False) -> Pretrained:
    """Resolve ``spec``: a weights file, a snapshot folder, or ``hf-hub:ORG/NAME[@revision]``
    (through ``huggingface_hub`` and its cache; ``HF_HUB_OFFLINE=1`` honoured; with ``local_only``
    the cache alone is read); or vitflow's own (:mod:`vitflow.models.pretrained.vitflow_source`): a
    run folder (its ``best.pt``, else its newest checkpoint), a vitflow checkpoint, a hub folder
    ``vitflow export --format hub`` wrote. This is the one answer to "what architecture does this
    source name": ``model_name`` and ``model_kwargs``.

    Raises:
        FileNotFoundError: no such file or folder. ValueError: a folder without weights, an
        unreadable config, a hub name neither cached nor downloadable (naming the repo and
        the cache it looked in), or ``auto`` (a planned run's choice, resolved before this).
    """
    text = str(spec)
    if text.startswith(HUB_PREFIX):
        return _resolve_folder(hub_snapshot(text[len(HUB_PREFIX):], local_only), text)
    if text == "auto":
        raise ValueError("model.pretrained=auto chooses a backbone for a planned run (vitflow train data.path=PHOTOS "
                         "with no preset); elsewhere name the weights: hf-hub:ORG/NAME, a folder or a file")
    path = Path(text).expanduser()
    if path.is_dir():
        run = vitflow_source.from_run(path)
        if run is None and ((path / RUN).is_file() or (path / CHECKPOINTS).is_dir()):
            raise FileNotFoundError(MESSAGES["run_without_checkpoint"].format(spec=text, folder=path / CHECKPOINTS))
        return Pretrained(**run, source=text) if run else _resolve_folder(path, text)
    if path.is_file():
        own = vitflow_source.from_checkpoint(path) if path.suffix in (".pt", ".pth") else None
        return Pretrained(**own, source=text) if own else Pretrained(weights=path, source=text)
    raise FileNotFoundError(f"model.pretrained: no such file or folder: {path}")


def hub_cache_dir() -> Path:
    """The ``huggingface_hub`` cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else the library's."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline_model_name(spec: str | Path) -> str | None:
    """The architecture ``spec``'s config names, read without the network (a snapshot folder, a
    cached ``hf-hub:`` snapshot), or None where there is none to read here (a bare weights file,
    a hub name not cached, an unreadable folder: :func:`resolve_pretrained` says why later)."""
    try:
        return resolve_pretrained(spec, local_only=True).model_name
    except (OSError, ValueError):
        return None


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE=1``, now or at
    ``huggingface_hub``'s import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or bool(
        getattr(constants, "HF_HUB_OFFLINE", False))


def hub_snapshot(name: str, local_only: bool = False) -> Path:
    """The local snapshot folder of hub repo ``ORG/NAME[@revision]``, downloaded into the cache
    unless the hub is offline (``HF_HUB_OFFLINE``) or ``local_only``, in which case only the
    cache is read.

    Raises:
        ValueError: neither cached nor downloadable (one line naming the repo and the cache).
    """
    from huggingface_hub import snapshot_download

    repo, _, revision = name.partition("@")
    if repo.count("/") != 1:
        raise ValueError(f"model.pretrained=hf-hub:{name}: expected hf-hub:ORG/NAME[@revision]")
    cache = hub_cache_dir()
    offline = local_only or hub_offline()
    if not offline and re.fullmatch(r"[0-9a-f]{40}", revision):  # a commit is immutable: a cached one is final
        try:
            return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True,
                                          allow_patterns=_HUB_PATTERNS))
        except Exception:  # not cached: from the hub below
            pass
    try:  # HF_ENDPOINT as it is now (huggingface_hub reads it once, at its import)
        folder = snapshot_download(repo, revision=revision or None, cache_dir=cache, local_files_only=offline,
                                   allow_patterns=_HUB_PATTERNS, endpoint=os.environ.get("HF_ENDPOINT") or None)
    except Exception as e:  # huggingface_hub's errors: not cached, offline, no network, no such repo
        why = "the hub is offline (HF_HUB_OFFLINE=1)" if offline else f"the hub could not be read ({type(e).__name__})"
        raise ValueError(MESSAGES["hub_offline"].format(name=name, repo=repo, cache=cache, why=why)) from None
    return Path(folder)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _resolve_folder(folder: Path, source: str) -> Pretrained:
    weights = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if weights is None:
        single = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        weights = single[0] if len(single) == 1 else None
    if weights is None:
        found = ", ".join(sorted(p.name for p in folder.iterdir())[:6]) or "nothing"
        sharded = " (sharded weights are not supported)" if (folder / "model.safetensors.index.json").exists() else ""
        raise ValueError(f"{folder}: a snapshot folder without weights (none of {', '.join(WEIGHT_FILES[:3])}, ...; "
                         f"found {found}){sharded}")
    out = Pretrained(weights=weights, source=source)
    config = _read_json(folder / "config.json")
    own = vitflow_source.from_hub_config(config, weights, folder) if config else None
    if own:
        return Pretrained(**own, source=source)
    oc = _read_json(folder / "open_clip_config.json")
    if config and "architecture" in config:
        _from_timm(config, out, folder / "config.json")
    elif config and "model_type" in config:
        _from_transformers(config, out, folder / "config.json")
    elif oc:
        _from_open_clip(oc, out)
    pp = _read_json(folder / "preprocessor_config.json")
    if pp and out.preprocess is None:
        out.preprocess = _from_preprocessor(pp)
    return out


def _from_timm(config: dict[str, Any], out: Pretrained, path: Path) -> None:
    out.model_name = str(config["architecture"])
    cfg = config.get("pretrained_cfg") or {}
    if isinstance(config.get("model_args"), dict):  # sizes timm was told beside the name (e.g. depth)
        out.model_kwargs.update(vitflow_kwargs(config["model_args"], str(path)))
    if "num_classes" in config:
        out.model_kwargs["num_classes"] = int(config["num_classes"])
    size = cfg.get("input_size") or (config.get("model_args") or {}).get("img_size")
    if size:
        out.model_kwargs["img_size"] = int(size[-1] if isinstance(size, (list, tuple)) else size)
    out.preprocess = {k: cfg[k] for k in ("mean", "std", "crop_pct", "interpolation") if k in cfg}
    if "img_size" in out.model_kwargs:
        out.preprocess["input_size"] = out.model_kwargs["img_size"]
    out.label_names = config.get("label_names")


def _size(width: int) -> str:
    return _WIDTHS.get(width, "small")


def _from_transformers(config: dict[str, Any], out: Pretrained, path: Path) -> None:
    kind = str(config["model_type"])
    if kind in HF_SWIN_TYPES:  # stage depths, heads and window: their own mapping
        out.model_name, kwargs = hf_swin_model_args(config, str(path))
        out.model_kwargs.update(kwargs)
        out.label_names = hf_swin_label_names(config)
        return
    if kind in ("clip", "siglip") and isinstance(config.get("vision_config"), dict):
        vision = {**config["vision_config"]}
        if kind == "clip" and config.get("projection_dim"):
            out.model_kwargs["num_classes"] = int(config["projection_dim"])
    else:
        vision = config
    try:
        d, p, img = int(vision["hidden_size"]), int(vision["patch_size"]), int(vision["image_size"])
        sizes = {"embed_dim": d, "depth": int(vision["num_hidden_layers"]),
                 "num_heads": int(vision["num_attention_heads"]), "patch_size": p, "img_size": img}
        if vision.get("intermediate_size"):
            sizes["mlp_ratio"] = int(vision["intermediate_size"]) / d
        elif vision.get("mlp_ratio"):  # DINOv2's configs
            sizes["mlp_ratio"] = float(vision["mlp_ratio"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: model_type {kind!r} without a usable {e} (hidden_size, num_hidden_layers, "
                         "num_attention_heads, patch_size, image_size)") from None
    size = _size(d)
    names = {"vit": f"vit_{size}_patch{p}_{img}", "dinov2": f"vit_{size}_patch{p}_dinov2",
             "dinov2_with_registers": f"vit_{size}_patch{p}_reg4_dinov2",
             "dinov3_vit": f"vit_{size}_patch{p}_dinov3" + ("_qkvb" if vision.get("query_bias", True) else ""),
             "beit": f"beit_{size}_patch{p}_{img}"}
    quick = "quickgelu_" if vision.get("hidden_act") == "quick_gelu" else ""
    for k in ("clip", "clip_vision_model"):
        names[k] = f"vit_{size}_patch{p}_clip_{quick}{img}"
    for k in ("siglip", "siglip_vision_model"):
        names[k] = f"vit_{size}_patch{p}_siglip_{'' if vision.get('vision_use_head', True) else 'gap_'}{img}"
    if kind not in names:
        raise ValueError(f"{path}: model_type {kind!r} is not one vitflow reads (one of {', '.join(names)})")
    out.model_name = names[kind]
    out.model_kwargs.update(sizes)
    labels = config.get("id2label")
    if kind in ("vit", "beit") and isinstance(labels, dict) and config.get("architectures", [""])[0].endswith(
            "ForImageClassification"):
        out.label_names = [labels[k] for k in sorted(labels, key=int)]
        out.model_kwargs["num_classes"] = len(labels)


def _from_open_clip(oc: dict[str, Any], out: Pretrained) -> None:
    model_cfg = oc.get("model_cfg") or {}
    vision = model_cfg.get("vision_cfg") or {}
    width, p, img = int(vision.get("width", 768)), int(vision.get("patch_size", 16)), vision.get("image_size", 224)
    img = int(img[0] if isinstance(img, (list, tuple)) else img)
    quick = "quickgelu_" if model_cfg.get("quick_gelu") else ""
    out.model_name = f"vit_{_size(width)}_patch{p}_clip_{quick}{img}"
    out.model_kwargs.update(embed_dim=width, patch_size=p, img_size=img)
    if "layers" in vision:
        out.model_kwargs["depth"] = int(vision["layers"])
    if "head_width" in vision:
        out.model_kwargs["num_heads"] = width // int(vision["head_width"])
    if "mlp_ratio" in vision:
        out.model_kwargs["mlp_ratio"] = float(vision["mlp_ratio"])
    if model_cfg.get("embed_dim"):
        out.model_kwargs["num_classes"] = int(model_cfg["embed_dim"])
    pp = oc.get("preprocess_cfg") or {}
    out.preprocess = {"input_size": img, "crop_pct": 1.0, **{k: pp[k] for k in ("mean", "std") if k in pp}}
    if pp.get("interpolation") in ("bilinear", "bicubic"):
        out.preprocess["interpolation"] = pp["interpolation"]


def _from_preprocessor(pp: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``preprocessor_config.json`` -> ``{"mean", "std", "input_size", "crop_pct",
    "interpolation"}`` (what it holds)."""
    def side(v: Any) -> int | None:
        if isinstance(v, dict):
            v = v.get("shortest_edge") or v.get("height")
        return int(v) if v else None

    out: dict[str, Any] = {}
    if "image_mean" in pp:
        out["mean"] = pp["image_mean"]
    if "image_std" in pp:
        out["std"] = pp["image_std"]
    resize, crop = side(pp.get("size")), side(pp.get("crop_size"))
    if pp.get("do_center_crop") and crop and resize:
        out["input_size"], out["crop_pct"] = crop, round(crop / resize, 4)
    elif resize:
        out["input_size"], out["crop_pct"] = resize, 1.0
    if pp.get("resample") in _PIL_FILTERS:
        out["interpolation"] = _PIL_FILTERS[pp["resample"]]
    return out
