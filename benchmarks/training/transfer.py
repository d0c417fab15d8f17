"""An honest transfer test on real pixels: does fine-tuning a vitflow-pretrained backbone beat
training the same architecture from scratch on a few labelled images?

    python benchmarks/training/transfer.py [--pretrain-budget 12m] [--steps 300] [--backbone CKPT] [--json]

1. Pretrain the compact CIFAR ViT (``cifar10-vit-tiny``'s model and the short-budget recipe of
   ``cifar10_budget.py``) on CIFAR-10 classes 0-4 (airplane .. deer: 25,000 training images), for a
   wall-clock budget; or take ``--backbone`` (a checkpoint or run directory of such a run).
2. Adapt it to classes 5-9 (dog .. truck) with 100 training images per class (the first 100 of each
   class folder), every method with the same number of steps and batch, evaluated on all 5,000
   test images of classes 5-9: scratch (same architecture, random init), linear probe, full
   fine-tuning with layer-wise lr decay, LP-FT (Kumar et al. 2022) and LoRA (Hu et al. 2021).
3. Fine-tune the backbone on ``hymenoptera.tar`` (ants / bees photos at 32 px, val split) against
   scratch, same steps.

The CIFAR tar is extracted once into ``--work`` (hard links build the class subsets).
Prints one line per method; with ``--json`` one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import tarfile
import time
from pathlib import Path

from vitflow.config import build_config
from vitflow.training import train

SHARED = Path(os.environ.get("VITFLOW_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PRETRAIN_RECIPE = ["train.batch_size=128", "optim.lr=7e-4", "optim.warmup_steps=100", "model.patch_drop_rate=0.5",
                   "data.train_augment=none", "train.label_smoothing=0", "train.eval_every=0"]
# the adaptation runs: small data, so crops and flips, label smoothing, AdamW
ADAPT = ["train.batch_size=64", "optim.warmup_steps=30", "data.train_augment=pad_crop", "train.label_smoothing=0.1",
         "train.eval_every=0", "train.checkpoint_every=0", "data.val_split=none"]
METHODS = {  # name: (pretrained?, overrides)
    "scratch": (False, ["optim.lr=1e-3"]),
    "linear_probe": (True, ["finetune.mode=linear_probe", "optim.lr=3e-3", "optim.weight_decay=0"]),
    "full_ft": (True, ["optim.lr=5e-4", "optim.layer_decay=0.75"]),
    "lp_ft": (True, ["finetune.mode=lp_ft", "finetune.probe_steps=0.3", "optim.lr=5e-4", "optim.layer_decay=0.75"]),
    "lora": (True, ["finetune.mode=lora", "finetune.lora_rank=8", "optim.lr=2e-3"]),
}


def build_folders(work: Path) -> tuple[Path, Path]:
    """``work/source`` (classes 0-4, all train and test images) and ``work/target`` (classes 5-9,
    100 train images per class, all 1,000 test images per class), hard-linked from the extracted tar."""
    raw = work / "raw"
    if not (raw / "cifar10").is_dir():
        with tarfile.open(SHARED / "cifar10-jpg.tar") as t:
            t.extractall(raw, filter="data")
    src, tgt = work / "source", work / "target"
    for split in ("train", "test"):
        for i, name in enumerate(CLASSES):
            files = sorted((raw / "cifar10" / split / name).iterdir())
            out = (src if i < 5 else tgt) / split / name
            if out.is_dir():
                continue
            out.mkdir(parents=True)
            for f in files[:100] if (i >= 5 and split == "train") else files:
                os.link(f, out / f.name)
    return src, tgt


def run(preset: str, overrides: list[str]) -> dict:
    t0 = time.perf_counter()
    r = train(build_config(preset, overrides=overrides))
    return {**r, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/vitflow-transfer", help="scratch folder (extracted images, runs)")
    ap.add_argument("--pretrain-budget", default="12m", help="wall-clock budget of the pretraining run")
    ap.add_argument("--backbone", help="a checkpoint or run directory to adapt instead of pretraining")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of every adaptation run")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--pretrain-only", action="store_true", help="stop after pretraining")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args()
    work = Path(args.work)
    src, tgt = build_folders(work)
    results: dict = {}
    backbone = args.backbone
    if backbone is None:
        r = run("cifar10-vit-tiny", [f"data.path={src}", f"train.time_budget={args.pretrain_budget}",
                                     f"train.run_dir={work / 'runs' / f'pretrain-{time.time():.0f}'}",
                                     *PRETRAIN_RECIPE])
        backbone = r["checkpoint"]
        results["pretrain"] = {"test_top1": r["test_top1"], "steps": r["step"], "wall_s": r["wall_s"]}
        print(f"pretrain (classes 0-4): test top-1 {r['test_top1']:.2%} after {r['step']} steps, {r['wall_s']:.0f} s;"
              f" backbone {backbone}", flush=True)
    if args.pretrain_only:
        return
    common = [f"train.total_steps={args.steps}", *ADAPT]
    for name in args.methods.split(","):
        pretrained, extra = METHODS[name]
        over = [f"data.path={tgt}", f"train.run_dir={work / 'runs' / f'{name}-{time.time():.0f}'}", *common, *extra]
        if pretrained:
            over.append(f"model.pretrained={backbone}")
        r = run("cifar10-vit-tiny", over)
        results[name] = {"test_top1": r["test_top1"], "wall_s": r["wall_s"],
                         "train_images_per_s": r["train_images_per_s"]}
        print(f"{name:>13}: test top-1 {r['test_top1']:.2%} on 5,000 images of classes 5-9 "
              f"({args.steps} steps, {r['wall_s']:.0f} s)", flush=True)
    hym = SHARED / "hymenoptera.tar"
    for name, pretrained in (("hymenoptera_scratch", False), ("hymenoptera_ft", True)):
        over = [f"data.path={hym}", "data.val_split=val", "data.test_split=none", "data.crop_pct=0.875",
                "data.train_augment=random_resized_crop", "data.scale=[0.35,1.0]", "train.batch_size=32",
                f"train.total_steps={args.steps}", "optim.warmup_steps=30", "train.eval_every=0",
                f"train.run_dir={work / 'runs' / f'{name}-{time.time():.0f}'}",
                *(["optim.lr=5e-4", "optim.layer_decay=0.75", f"model.pretrained={backbone}"] if pretrained
                  else ["optim.lr=1e-3"])]
        r = run("cifar10-vit-tiny", over)
        results[name] = {"val_top1": r["val_top1"], "wall_s": r["wall_s"]}
        print(f"{name:>20}: val top-1 {r['val_top1']:.2%} on 153 photos ({args.steps} steps, {r['wall_s']:.0f} s)",
              flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
