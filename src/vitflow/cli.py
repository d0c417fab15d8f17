"""``vitflow <command>``: parses arguments, builds the config, calls one layer. Nothing else."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from vitflow.config import ConfigError, build_config, list_presets, preset_tree, to_yaml


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="named recipe (see `vitflow presets`); default digits-vit-tiny")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of sections applied over the preset")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitflow", description="Train, evaluate and deploy Vision Transformers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: a small ViT on the embedded digits data)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.total_steps=500")

    p = sub.add_parser("eval", help="evaluate a checkpoint on its test split")
    p.add_argument("checkpoint", help="checkpoint file or run directory (newest checkpoint)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.path=... data.test_split=test")

    p = sub.add_parser("predict", help="classify images, folders or tars")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR", help="image files, folders or .tar archives")
    p.add_argument("--topk", type=int, default=5, help="classes to show per image (default 5)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per image")

    p = sub.add_parser("attention", help="draw a checkpoint's attention maps and rollout on an image")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("image", help="an image file")
    p.add_argument("-o", "--output", default="attention.png", help="PNG to write (default attention.png)")
    p.add_argument("--layer", type=int, default=-1, help="block whose per-head maps are drawn (default -1, the last)")
    p.add_argument("--head-fusion", choices=["mean", "max", "min"], default="mean",
                   help="how rollout combines the heads of a layer (default mean)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    p = sub.add_parser("prepare", help="pack a folder, tar or CIFAR batches into a memory-mapped dataset")
    p.add_argument("src", help="image folder, .tar of one, or CIFAR-10/100 python batches folder")
    p.add_argument("out", help="output folder (written as OUT.partial, renamed when complete)")
    p.add_argument("--format", choices=["auto", "raw", "jpeg"], default="auto",
                   help="raw uint8 (small fixed-size images) or re-encoded JPEG; auto picks")
    p.add_argument("--max-side", type=int, help="jpeg: downscale so the longer side is at most N px")
    p.add_argument("--quality", type=int, default=90, help="jpeg quality (default 90)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: cores)")
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset at OUT")

    p = sub.add_parser("bench", help="measure throughput against baselines")
    bench = p.add_subparsers(dest="what", required=True)
    b = bench.add_parser("data", help="input pipeline: decode limit, torchvision baseline, vitflow, packed")
    b.add_argument("--data", required=True, help="image folder or tar (class folders, or a flat folder of images)")
    b.add_argument("--image-size", type=int, default=224)
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--passes", type=int, help="epochs per repeat (default 3, or 1 for > 20k images)")
    b.add_argument("--batch-size", type=int, help="default 64, or 256 at <= 64 px")
    b.add_argument("--max-side", type=int, help="packed JPEG longer side (default 256)")
    b.add_argument("--json", action="store_true", help="end with one JSON line of images/s")

    p = sub.add_parser("presets", help="list presets, or print one resolved")
    p.add_argument("name", nargs="?")

    p = sub.add_parser("models", help="list model variants")
    p.add_argument("pattern", nargs="?", help="shell pattern, e.g. 'vit_small_*'")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from vitflow.train import train

    r = train(cfg)
    print(f"test top-1 {r['test_top1']:.2%}  top-5 {r['test_top5']:.2%}  loss {r['test_loss']:.4f}  "
          f"({r['step']} steps, {r['elapsed_s']:.0f} s, {r['train_images_per_s']:.0f} img/s)")
    if r["skipped_images"]:
        print(f"skipped {r['skipped_images']} unreadable image(s); see the warnings above")
    print(f"run directory: {r['run_dir']}\ncheckpoint: {r['checkpoint']}")
    if "samples" in r:
        print(f"sample test images: {r['samples']}  (try: vitflow predict {r['run_dir']} {r['samples']})")
    if args.json:
        print(json.dumps(r))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from vitflow.train.evaluate import evaluate_checkpoint

    r = evaluate_checkpoint(args.checkpoint, args.overrides)
    print(f"test top-1 {r['test_top1']:.2%}  top-5 {r['test_top5']:.2%}  loss {r['test_loss']:.4f}  "
          f"({r['test_images']} images, {r['checkpoint']})")
    if args.json:
        print(json.dumps(r))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from vitflow.infer import Predictor, collect_images

    predictor = Predictor.from_checkpoint(args.checkpoint, args.device, args.precision)
    refs = collect_images(args.inputs)
    if not refs:
        raise FileNotFoundError(f"no images found in {' '.join(args.inputs)}")
    failed = 0
    for r in predictor.predict_refs(refs, args.topk, args.batch_size):
        failed += "error" in r
        if args.json:
            print(json.dumps(r))
        elif "error" in r:
            print(f"{r['path']}: ERROR {r['error']}", file=sys.stderr)
        else:
            print(f"{r['path']}: " + ", ".join(f"{t['class']} {t['prob']:.1%}" for t in r["top"]))
    if failed:
        print(f"{failed} of {len(refs)} image(s) could not be read", file=sys.stderr)
    return 1 if failed == len(refs) else 0


def cmd_attention(args: argparse.Namespace) -> int:
    from vitflow.viz import attention_figure

    r = attention_figure(args.checkpoint, args.image, args.output, args.layer, args.head_fusion)
    print(f"{r['image']}: predicted {r['class']} ({r['prob']:.1%}); {r['heads']} heads of block {r['layer']} "
          f"and the rollout on a {r['grid'][0]}x{r['grid'][1]} grid -> {r['output']}")
    if args.json:
        print(json.dumps(r))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from vitflow.data.packed import prepare

    meta = prepare(args.src, args.out, args.format, args.max_side, args.quality, args.workers, args.force)
    for name, info in meta["splits"].items():
        print(f"{name}: {info['count']} images ({info['kind']}), {info['skipped']} skipped")
    print(f"packed dataset: {args.out}  (train with data.path={args.out})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from vitflow.data.bench import run

    result = run(args.data, args.image_size, args.workers, args.repeats, args.passes, args.batch_size, args.max_side)
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    if args.name:
        preset_tree(args.name)  # fails with the nearest names if unknown
        print(to_yaml(build_config(args.name)), end="")
        return 0
    for name, desc in list_presets().items():
        print(f"{name:28s} {desc}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from vitflow.models import MODELS, list_models

    for name in list_models(args.pattern):
        m = MODELS[name]
        print(f"{name:26s} img {m['img_size']:>3}  patch {m['patch_size']:>2}  dim {m['embed_dim']:>4}  "
              f"depth {m['depth']:>2}  heads {m['num_heads']:>2}  mlp {m.get('mlp_ratio', 4.0):g}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "predict": cmd_predict, "attention": cmd_attention,
            "prepare": cmd_prepare, "bench": cmd_bench, "presets": cmd_presets, "models": cmd_models}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if args.debug or os.environ.get("VITFLOW_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
