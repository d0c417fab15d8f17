"""The model card (``README.md``) of a hub-style model folder: what the model is, how it scored, its
classes and preprocessing, and how to load it in vitflow and timm. The front matter follows the
Hugging Face model-card metadata (``library_name``, ``tags``, ``pipeline_tag``)."""

from __future__ import annotations

from typing import Any

MAX_CLASSES_LISTED = 100


def _pct(v: Any) -> str:
    return f"{v:.2%}" if isinstance(v, (int, float)) else "-"


def _results(state: dict[str, Any], run_eval: dict[str, Any] | None) -> list[str]:
    if run_eval is not None:
        where = f"{run_eval.get('split', '?')} split (`{run_eval.get('split_expr', '?')}`)"
        r, note = run_eval, f"the run's final evaluation, {run_eval.get('weights', '?')} weights"
    elif state.get("metrics"):
        r, where, note = state["metrics"], "last evaluation", "the checkpoint's last evaluation"
    else:
        return ["No evaluation was saved with this checkpoint."]
    if "map" in r:
        head = "| data | images | mAP | micro-F1 | macro-F1 | loss |\n|---|---|---|---|---|---|"
        row = f"| {where} | {r.get('images', '-')} | {_pct(r['map'])} | {_pct(r.get('micro_f1'))} | " \
              f"{_pct(r.get('macro_f1'))} | {r.get('loss', float('nan')):.4f} |"
    else:  # no top-5 column for fewer than 6 classes (the evaluation leaves it out: it is always 100%)
        top5 = "top5" in r
        head = "| data | images | top-1 |" + (" top-5 |" if top5 else "") + " loss |\n|---|---|---|" + \
            ("---|" if top5 else "") + "---|"
        row = f"| {where} | {r.get('images', '-')} | {_pct(r.get('top1'))} | " + \
            (f"{_pct(r.get('top5'))} | " if top5 else "") + f"{r.get('loss', float('nan')):.4f} |"
    return [f"Measured by vitflow ({note}, step {state.get('step')}):", "", head, row]


def model_card(state: dict[str, Any], config: dict[str, Any], name: str, run_eval: dict[str, Any] | None = None) -> str:
    """Markdown of the card.

    Args:
        state: the vitflow checkpoint (``config``, ``classes``, ``model_args``, ``metrics``, ``step``).
        config: the folder's ``config.json`` (:func:`vitflow.infer.export.hub_folder.hub_config`).
        name: the folder's name (the card's title).
        run_eval: the run's ``eval.json`` for this step, if any.
    """
    run_cfg = state.get("config") or {}
    data = run_cfg.get("data") or {}
    pcfg, classes = config["pretrained_cfg"], config["label_names"]
    size = pcfg["input_size"][-1]
    listed = [f"- `{i}`: {c}" for i, c in enumerate(classes[:MAX_CLASSES_LISTED])]
    if len(classes) > MAX_CLASSES_LISTED:
        listed.append(f"... and {len(classes) - MAX_CLASSES_LISTED} more (all in config.json's label_names)")
    vit_name = state["model_args"]["name"]
    lines = [
        "---", "library_name: timm", "pipeline_tag: image-classification", "tags:", "- image-classification",
        "- vitflow", "- timm", "---", "", f"# {name}", "",
        f"A `{vit_name}` image classifier ({len(classes)} classes, {config['num_features']}-wide features, "
        f"{config['global_pool']} pooling) trained with vitflow for {state.get('step')} steps"
        f" (preset `{run_cfg.get('preset', '?')}`, data `{data.get('path') or data.get('source', '?')}`, "
        f"task {config['vitflow']['task']}).", "", "## Results", "", *_results(state, run_eval), "",
        "## Classes", "", *listed, "", "## Preprocessing", "",
        f"Decode as RGB (EXIF orientation applied), resize the shorter side to "
        f"{round(size / pcfg['crop_pct'])} px ({pcfg['interpolation']}), center-crop {size} x {size}, scale to "
        f"[0, 1], normalise with mean {pcfg['mean']} and std {pcfg['std']} (`pretrained_cfg` in config.json).", "",
        "## Use it", "", "vitflow (classify, embed, k-NN of the frozen features, or in Python):", "", "```bash",
        f"vitflow predict {name} photos/", f"vitflow embed {name} photos/ -o features.npy",
        f"vitflow eval {name} --knn 20 --data PATH", "```", "",
        "```python", "from vitflow.infer.export.hub_folder import read_hub_folder", "",
        f'hub = read_hub_folder("{name}")  # hub.model (eval mode, with its head), hub.preprocess, hub.classes',
        "```", "",
        "timm (a version that reads `local-dir:` folders; written and tested with timm 1.0.31):", "", "```python", "import timm", "",
        f'model = timm.create_model("local-dir:{name}", pretrained=True).eval()',
        "config = timm.data.resolve_data_config({}, model=model)",
        "transform = timm.data.create_transform(**config)", "```", "",
        "## Files", "", "- `config.json`: timm's model config (architecture, model_args, pretrained_cfg, label_names); "
        "`vitflow` holds vitflow's own model arguments",
        "- `model.safetensors`: the weights, with timm's parameter names", "- `README.md`: this card", "",
    ]
    if state["model_args"].get("pos_embed") == "sincos2d":
        lines += ["## Position embedding", "", f"Trained with fixed 2-D sin-cos positions; `model.safetensors` holds that "
                  f"table as timm's learned `pos_embed` (the same logits at {size} px; timm resamples it for another "
                  "size, vitflow recomputes the sin-cos table).", ""]
    return "\n".join(lines)
