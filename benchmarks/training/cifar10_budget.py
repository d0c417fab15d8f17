"""Train on the shared CIFAR-10 JPEG tar for a fixed wall-clock budget and print the test top-1 on
the 10,000 test images: through vitflow's plan alone (the default), or the hand-made recipe.

    python benchmarks/training/cifar10_budget.py [--budget 15m] [--recipe] [--data PATH] [--model vit|swin|mvit] [--json] [key=value ...]

Default: ``vitflow train data.path=TAR train.time_budget=BUDGET`` as a user types it — the plan
(:mod:`vitflow.training.plan.recipe`) chooses the model, pooling, positions, PatchDropout, batch, lr,
threads, length and augmentation from the data and this machine's measured step time, and logs
each choice with its reason. ``train.eval_every=0`` (no periodic evaluation of the 10,000 test
images, as for the recipe) is the benchmark's own setting, not a recipe choice.

``--recipe``: the ``cifar10-vit-tiny`` preset with the short-budget recipe in ``RECIPE`` — a run
that sees ~6 epochs underfits, so it drops the crop augmentation and label smoothing (flips stay),
halves the tokens per image with PatchDropout (~1.9x the images/s) and uses batch 128 at lr 7e-4,
each choice measured in 5-minute probes (docs/guides/benchmarks.md). The tar is read in place (no
extraction). The budget covers training, the final evaluation and the checkpoint; the schedule is
fitted to it after the first steps (``train.time_budget``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vitflow.config import build_config
from vitflow.models import config_class
from vitflow.training import train
from vitflow.training.checks import CONFIG_CHECKS
from vitflow.training.plan.recipe import planned_config

DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "cifar10-jpg.tar"
# --model swin: the 32x32 Swin (patch 2, window 4) on the same recipe, without the ViT's PatchDropout (a
# Swin has no such key: it would break the window grid; the preset's ViT-only pos_embed is left out by
# build_config); the attention backend timed
SWIN = ["model.name=swin_cifar_patch2_window4_32", "model.attention=auto"]
# --model mvit: the 32x32 MViTv2 (patch stride 2, three stages on 16x16 / 8x8 / 4x4 grids) on the same recipe,
# without the ViT's PatchDropout (it would break the pooling grids; an MViT has no such key); the
# pooling-attention backend timed
MVIT = ["model.name=mvitv2_cifar_32", "model.attention=auto"]
VIT = ["model.patch_drop_rate=0.5"]
MODELS = {"vit": VIT, "swin": SWIN, "mvit": MVIT}
RECIPE = ["train.batch_size=128", "optim.lr=7e-4", "optim.warmup_steps=100", "data.train_augment=none",
          "train.label_smoothing=0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", default="15m", help="wall-clock budget (default 15m)")
    ap.add_argument("--recipe", action="store_true", help="the cifar10-vit-tiny preset + RECIPE instead of the plan")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="CIFAR-10 folder or tar with train/ and test/")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--model", default="vit", choices=tuple(MODELS),
                    help="vit, swin (SWIN) or mvit (MVIT); with --recipe, the model's recipe keys")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = ap.parse_args()
    t0, load = time.perf_counter(), os.getloadavg()[0]
    given = [f"data.path={args.data}", f"train.time_budget={args.budget}", "train.eval_every=0"]
    if args.recipe:
        cfg = build_config("cifar10-vit-tiny", overrides=[*given, *RECIPE, *MODELS[args.model], *args.overrides],
                           model_config=config_class)
    else:
        cfg = planned_config([*given, *(MODELS[args.model][:1] if args.model != "vit" else []), *args.overrides],
                             CONFIG_CHECKS)
    r = train(cfg)
    wall = time.perf_counter() - t0
    how = "recipe" if args.recipe else "plan"
    name = (r.get("race") or {}).get("winner", cfg.model.name)  # a race's winner is the model trained on
    print(f"cifar10-{name} ({how}), budget {args.budget}: test top-1 {r['test_top1']:.2%} top-5 "
          f"{r['test_top5']:.2%} on 10,000 test images after {r['step']} steps "
          f"({r['step'] * cfg.train.batch_size / 50_000:.1f} epochs), {r['train_images_per_s']:.0f} train img/s, "
          f"threads {cfg.train.threads or 'default'}, wall {wall:.0f} s (plan included), load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    if args.json:
        print(json.dumps({**r, "budget": args.budget, "wall_s": wall, "how": how, "load_start": load,
                          "load_end": os.getloadavg()[0], "threads": cfg.train.threads}))


if __name__ == "__main__":
    main()
