"""The table of the messages users meet most, each once: the line the code prints (a
``str.format`` template) and the troubleshooting entry that explains it (its title, cause and
fix, and example values for the page). The code formats its error from the entry
(``MESSAGES["hub_offline"].format(spec=..., repo=..., cache=..., why=...)``) and the
documentation hook renders the entries into ``docs/troubleshooting.md`` (at each ``<!--
vitflow-messages: SECTION -->`` marker), so that searching the printed line finds its entry.
Pure data: imports nothing of vitflow. ``tests/test_messages.py`` triggers the common cases and
checks that what they print comes from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Message:
    """One message: ``key`` (how the code names it), the troubleshooting ``section`` and
    ``title`` it is listed under, its ``template`` (``str.format`` fields), ``example`` values
    for the page, the ``cause`` and the ``fix`` (Markdown), and ``prefix``: how the CLI prints it
    (``error: ``, or a log line's ``WARNING vitflow.x: ``)."""

    key: str
    section: str
    title: str
    template: str
    example: dict[str, str] = field(default_factory=dict)
    cause: str = ""
    fix: str = ""
    prefix: str = "error: "

    def format(self, **values: object) -> str:
        """The printed line with ``values`` in the template's fields."""
        return self.template.format(**values)

    def pattern(self) -> re.Pattern:
        """A regular expression matching any line :meth:`format` can give (each field: any text)."""
        parts = re.split(r"\{[^{}]*\}", self.template)
        return re.compile("^" + ".+?".join(re.escape(p) for p in parts) + "$", re.S)


MESSAGES: dict[str, Message] = {m.key: m for m in (
    Message(
        "no_eval_split", "Data", "No validation or test split",
        "{path} has no validation or test split (splits: {splits}): hold out part of the training images with "
        "data.train_split='{train}[:80%]' data.val_split='{train}[80%:90%]' data.test_split='{train}[90%:]', "
        "or move them into val/ and test/ folders (slices are re-drawn when images are added)",
        {"path": "pets", "splits": "train", "train": "train"},
        "The data has only a train split (class folders without `train/`, `val/`, `test/`; a label file without "
        "a split column).",
        "Hold out part of the train split with slices, as the message shows (the slices are disjoint and "
        "stratified; one image added re-draws them all, so data that grows is better split into folders); `val`, `valid` and `validation` folders or split values are found by `data.val_split=auto`, "
        "`test` by `data.test_split=auto`."),
    Message(
        "quantize_no_split", "Deployment", "quantize --data without a test or validation split",
        "--data {path}: no test or validation split to measure on (splits: {splits}); give the folder of the split "
        "itself (e.g. --data {path}/test, a folder of class folders) or --split NAME",
        {"path": "photos", "splits": "train"},
        "`vitflow quantize --data DIR` measures top-1 before and after on DIR's test split (its validation split "
        "when it has no test split). A folder with only `train/` has neither.",
        "Give a folder of the split itself: `--data PHOTOS/test` (class folders at its root: all its images are "
        "measured), or the data with `--split NAME` (`--split 'train[90%:]'` holds out part of it)."),
    Message(
        "hub_offline", "Checkpoints and resume", "A hub name that is not in the cache",
        "model.pretrained=hf-hub:{name}: {repo} is not in the Hugging Face cache {cache} and {why}",
        {"name": "timm/vit_small_patch14_reg4_dinov2.lvd142m", "repo": "timm/vit_small_patch14_reg4_dinov2.lvd142m",
         "cache": "/data/hf/hub", "why": "the hub is offline (HF_HUB_OFFLINE=1)"},
        "`hf-hub:` names are read through `huggingface_hub`'s cache; offline (or without a network) only what is "
        "cached can load.",
        "On a machine with a network, fill the cache once (`huggingface-cli download REPO`, or any run that "
        "loads it), with the same `HF_HOME` / `HF_HUB_CACHE`; or download the snapshot folder and give its path."),
    Message(
        "no_backbone", "Checkpoints and resume", "No pretrained backbone for a planned run",
        "model.pretrained=auto: {why}: training from scratch. A backbone pretrained on ImageNet is the usual start "
        "on a few thousand photos: fetch one where there is a network (hf download {hub}), or point HF_ENDPOINT "
        "at a mirror; model.pretrained=none trains from scratch without this line",
        {"why": "no backbone in the Hugging Face cache /root/.cache/huggingface/hub and the hub "
                "https://huggingface.co could not be reached", "hub": "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"},
        "`vitflow train data.path=PHOTOS` fine-tunes a pretrained backbone (`model.pretrained=auto`): the first of "
        "its table (ViT-Ti/16, DeiT III-S, ViT-S/16, MViTv2-T, DINOv2-S) found in the Hugging Face cache, else "
        "downloaded from the hub when it answers within 3 seconds. Neither was possible.",
        "Fill the cache once on a machine with a network (`hf download REPO`, with the same `HF_HOME` / "
        "`HF_HUB_CACHE`), or set `HF_ENDPOINT` to a hub mirror you can reach; `model.pretrained=none` says that "
        "training from scratch is meant."),
    Message(
        "auto_without_architecture", "Checkpoints and resume", "model.name=auto with a bare weights file",
        "model.name=auto: {spec} has no config naming an architecture (a snapshot folder with config.json or "
        "open_clip_config.json, or a vitflow run, checkpoint or hub folder); set model.name",
        {"spec": "w.safetensors"},
        "A fine-tune takes the architecture from the weights' source, and a bare `.safetensors` / `.pth` names "
        "none. A vitflow run folder, checkpoint or hub folder names its own.",
        "Name it: `model.name=vit_small_patch14_reg4_dinov2` (`vitflow models` lists the names; they are timm's), "
        "or give the snapshot folder or vitflow run instead. The head of another class count is re-initialised "
        "either way (`head reset: 1000 -> 5 classes` in the log)."),
    Message(
        "run_without_checkpoint", "Checkpoints and resume", "A run without a checkpoint as pretrained weights",
        "model.pretrained={spec}: a run folder without a checkpoint yet (none in {folder}); wait for its first "
        "checkpoint or name a file",
        {"spec": "runs/pets", "folder": "runs/pets/checkpoints"},
        "`model.pretrained=RUN` takes the run's `checkpoints/best.pt`, else its newest `step-N.pt`; this run has "
        "written none yet (a checkpoint comes with each evaluation of a planned run, and at the end).",
        "Wait for the run's first checkpoint, or name a checkpoint file of another run."),
    Message(
        "run_dir_taken", "Checkpoints and resume", "A run folder that is taken",
        "train.run_dir={path} holds another run ({shown}): continue it with `vitflow resume {path}`, or choose a "
        "new folder for this run",
        {"path": "runs/pets", "shown": "checkpoints, config.yaml, eval.json, metrics.jsonl and 4 more"},
        "A new run writes only into a new or empty folder, so that it never mixes its files (and its checkpoint "
        "rotation) with another run's. Nothing in the folder was touched.",
        "As the message says: `vitflow resume RUN` to continue that run, or another folder."),
    Message(
        "run_dir_not_empty", "Checkpoints and resume", "A run folder that holds other files",
        "train.run_dir={path} is not empty ({shown}) and is not a vitflow run: vitflow writes a run only into a new "
        "or empty folder; choose another train.run_dir",
        {"path": "photos", "shown": "notes.txt"},
        "A new run writes only into a new or empty folder; this one holds files that are not a vitflow run's. "
        "Nothing in the folder was touched.",
        "Choose another `train.run_dir` (or leave it unset: `runs/<preset>-<time>`)."),
    Message(
        "hub_relative_positions", "Deployment", "export --format hub of a model with relative positions",
        "model.pos_embed='relative': timm's VisionTransformer has no relative position bias (a per-head table added "
        "to every block's attention logits), so timm cannot rebuild this model; vitflow reads it (vitflow export "
        "--format onnx for other runtimes)",
        {},
        "A hub folder is for timm, whose `VisionTransformer` takes a learned (or fixed) position table added to "
        "the tokens. Fixed 2-D sin-cos positions are written as that table (same logits); a relative bias inside "
        "every block's attention has no timm counterpart.",
        "Read the folder with vitflow (`vitflow predict`, `read_hub_folder`), or export ONNX for other runtimes; "
        "train with `model.pos_embed=learned` or `sincos2d` for a timm-loadable model."),
)}


def render(section: str) -> str:
    """The troubleshooting entries of ``section`` (Markdown: a heading, the example line in a
    ``text`` block, the cause and the fix), in table order."""
    out = []
    for m in MESSAGES.values():
        if m.section == section:
            out.append(f"### {m.title}\n\n```text\n{m.prefix}{m.format(**m.example)}\n```\n\n"
                       f"**Cause.** {m.cause}\n**Fix.** {m.fix}\n")
    return "\n".join(out)
