"""``vitflow <command>``: parses arguments, builds the config, calls one layer. Nothing else."""

from __future__ import annotations

import argparse
import contextlib
import csv
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


def _add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="auto: the EMA weights when the checkpoint has them (default), else the trained ones")


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _add_verbosity(p: argparse.ArgumentParser, default) -> None:
    """``-v`` / ``-q``, accepted before and after the command (``default`` is SUPPRESS on the
    commands, so that they do not reset a value given before them)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG, default=default,
                   help="also vitflow's debug lines (each cpu_bf16_matmul=auto timing, the num_workers=auto probe)")
    g.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING, default=default,
                   help="warnings and errors only (no info lines, no progress bars)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitflow", description="Train, evaluate and deploy Vision Transformers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    _add_verbosity(parser, logging.INFO)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: a small ViT on the embedded digits data)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel on N local processes (runs torchrun --standalone --nproc-per-node N)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.total_steps=500")

    p = sub.add_parser("eval", help="evaluate a checkpoint on its test split")
    p.add_argument("checkpoint", help="checkpoint file or run directory (newest checkpoint)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
    _add_weights_arg(p)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.path=... data.test_split=test")

    p = sub.add_parser("predict", help="classify images, folders or tars")
    p.add_argument("checkpoint", help="checkpoint file, run directory, or an exported .onnx model")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR", help="image files, folders or .tar archives")
    p.add_argument("--topk", type=_positive, default=5, help="classes to show per image (default 5)")
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--workers", type=int, default=2, help="image decoding threads (default 2)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16: run a PyTorch model with its weights cast to that dtype (fp16 needs CUDA)")
    p.add_argument("--device", default="auto")
    _add_weights_arg(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object per image")
    fmt.add_argument("--csv", action="store_true", help="CSV: path,rank,class,index,prob,error (one row per class)")

    p = sub.add_parser("export", help="export a checkpoint (ONNX, TorchScript, ExportedProgram, TensorRT), verified")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("--format", default="onnx", choices=["onnx", "torchscript", "exported-program", "tensorrt"])
    p.add_argument("-o", "--output", required=True, help="output file (.onnx, .ts, .pt2, .engine)")
    p.add_argument("--optimize", action="store_true", help="ONNX: apply ONNX Runtime's transformer fusions")
    p.add_argument("--target", choices=["cpu", "gpu"], help="--optimize for this target (default: gpu if CUDA "
                   "is available, else cpu)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset (>= 17; default 18)")
    p.add_argument("--verify-data", metavar="PATH", help="real images (file, folder or tar) to verify on; "
                   "default: the checkpoint's test split")
    p.add_argument("--tolerance", type=float, help="max |logit difference| (default 1e-4; 0.1 for FP16 TensorRT)")
    p.add_argument("--fp32", action="store_true", help="TensorRT: build an FP32 engine (default FP16)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    p = sub.add_parser("quantize", help="INT8 (ONNX Runtime or PyTorch) or FP16/BF16 weights, with an accuracy guard")
    p.add_argument("model", help="checkpoint, run directory, or a vitflow .onnx model (onnxruntime backend)")
    p.add_argument("-o", "--output", required=True, help="output: .onnx (onnxruntime) or .pt (torch)")
    p.add_argument("--backend", choices=["onnxruntime", "torch"], default="onnxruntime")
    p.add_argument("--dtype", choices=["int8", "fp16", "bf16"], default="int8",
                   help="int8 (default); fp16/bf16 weight casting for GPU inference (torch backend)")
    p.add_argument("--data", metavar="PATH", help="image folder or tar to measure top-1 before and after")
    p.add_argument("--split", help="split of --data (default test; e.g. 'test[:2000]')")
    p.add_argument("--max-drop", type=float, default=1.0, help="max top-1 drop in points (default 1.0)")
    p.add_argument("--force", action="store_true", help="write the model even if top-1 dropped more")
    p.add_argument("--per-tensor", action="store_true", help="ONNX: one weight scale per tensor (default per channel)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    p = sub.add_parser("prune", help="remove attention heads / MLP units, optionally fine-tune with distillation")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("-o", "--output", required=True, help="pruned checkpoint (.pt)")
    p.add_argument("--heads", type=float, default=0.25, help="fraction of all attention heads to remove (0.25)")
    p.add_argument("--mlp", type=float, default=0.0, help="fraction of all MLP hidden units to remove (0)")
    p.add_argument("--data", metavar="PATH", help="dataset folder or tar (default: the checkpoint's data.path)")
    p.add_argument("--calib-images", type=int, default=1024, help="images for the importance scores (1024)")
    p.add_argument("--finetune-steps", type=int, default=0, help="distillation fine-tune steps (default 0: none)")
    p.add_argument("--batch-size", type=int, default=128, help="fine-tune batch size (128)")
    p.add_argument("--lr", type=float, default=5e-4, help="fine-tune peak learning rate (5e-4)")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the distillation loss (0.5)")
    p.add_argument("--temperature", type=float, default=2.0, help="distillation temperature (2)")
    p.add_argument("--no-eval", action="store_true", help="skip the top-1 measurements")
    p.add_argument("--eval-split", help="split to measure top-1 on (default: the checkpoint's test split)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

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

    p = sub.add_parser("bench", help="measure throughput against baselines (data, infer)")
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
    b = bench.add_parser("infer", help="inference latency / throughput of every deployment path vs timm")
    b.add_argument("checkpoint", help="checkpoint file or run directory")
    b.add_argument("--paths", help="comma-separated subset of the paths (default: all seven, see README)")
    b.add_argument("--batch-size", type=int, default=32, help="throughput batch size (32)")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds (3)")
    b.add_argument("--latency-calls", type=int, default=20, help="batch-1 calls per path per round (20)")
    b.add_argument("--min-time", type=float, default=1.0, help="seconds of batch calls per path per round (1)")
    b.add_argument("--attention", help="attention backend of the vitflow eager/compiled paths (default: the checkpoint's)")
    b.add_argument("--threads", type=int, help="torch and ONNX Runtime threads (default: torch's default)")
    b.add_argument("--json", action="store_true", help="end with one JSON line {path: {latency_ms_p50, ...}}")

    p = sub.add_parser("lr-schedule", help="plot the learning-rate schedule a config will use")
    _add_config_args(p)
    p.add_argument("-o", "--output", default="lr.png", help="PNG to write (default lr.png)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.schedule=restarts")

    p = sub.add_parser("report", help="write PNG curves and one self-contained HTML page for a run")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, config.yaml, eval.json)")
    p.add_argument("-o", "--output", help="HTML file (default RUN_DIR/report.html; PNGs beside it in report/)")

    p = sub.add_parser("presets", help="list presets, or print one resolved")
    p.add_argument("name", nargs="?")

    p = sub.add_parser("models", help="list model variants")
    p.add_argument("pattern", nargs="?", help="shell pattern, e.g. 'vit_small_*'")
    for name, p in [*sub.choices.items(), *bench.choices.items()]:
        if name != "bench":
            _add_verbosity(p, argparse.SUPPRESS)
    return parser


def _print_json(args: argparse.Namespace, obj) -> None:
    """The ``--json`` result line, on the real stdout (:func:`main` sends every other line of a
    ``--json`` command to stderr, so that ``vitflow eval RUN --json | jq`` works)."""
    print(json.dumps(obj), file=getattr(args, "json_stdout", None) or sys.stdout)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        if cfg.data.path and not os.path.exists(cfg.data.path):  # shown, but training would stop here
            print(f"warning: data.path {cfg.data.path} does not exist", file=sys.stderr)
        return 0
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:  # become torchrun; it starts the N ranks
        from vitflow.train.distributed import torchrun_command

        argv = (["--debug"] if args.debug else []) + {logging.DEBUG: ["-v"], logging.WARNING: ["-q"]}.get(
            args.log_level, []) + ["train"] + (["--preset", args.preset] if args.preset else []) + (
            ["--config", args.config] if args.config else []) + (["--json"] if args.json else []) + args.overrides
        cmd = torchrun_command(args.nproc, argv)
        os.execv(cmd[0], cmd)
    from vitflow.train import train
    from vitflow.train.guards import NonFiniteError

    try:
        r = train(cfg)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports
        return 0
    if "interrupted" in r:
        print(f"{r['interrupted']}: stopped at step {r['step']}; checkpoint: {r['checkpoint']}\n"
              f"continue with: vitflow train ... train.resume=auto train.run_dir={r['run_dir']}")
        if args.json:
            _print_json(args, r)
        return 128 + {"SIGTERM": 15, "SIGINT": 2}[r["interrupted"]]
    print(f"test top-1 {r['test_top1']:.2%}  top-5 {r['test_top5']:.2%}  loss {r['test_loss']:.4f}  "
          f"({r['step']} steps, {r['elapsed_s']:.0f} s, {r['train_images_per_s']:.0f} img/s)")
    if r["skipped_images"] or r["test_skipped"]:
        print(f"skipped unreadable images: {r['skipped_images']} in training, {r['test_skipped']} in the final "
              "evaluation; see the warnings above")
    print(f"run directory: {r['run_dir']}\ncheckpoint: {r['checkpoint']}")
    if "samples" in r:
        print(f"sample test images: {r['samples']}  (try: vitflow predict {r['run_dir']} {r['samples']})")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from vitflow.train.evaluate import evaluate_checkpoint

    r = evaluate_checkpoint(args.checkpoint, args.overrides, weights=args.weights)
    print(f"test top-1 {r['test_top1']:.2%}  top-5 {r['test_top5']:.2%}  loss {r['test_loss']:.4f}  "
          f"({r['test_images']} images, {r['weights']} weights, {r['checkpoint']})")
    if r["test_skipped"]:
        print(f"skipped {r['test_skipped']} unreadable image(s); see the warnings above")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from vitflow.infer import Predictor, collect_images

    predictor = Predictor.load(args.checkpoint, args.device, args.precision, args.weights)
    refs = collect_images(args.inputs)
    if not refs:
        raise FileNotFoundError(f"no images found in {' '.join(args.inputs)}")
    failed = 0
    writer = csv.writer(sys.stdout, lineterminator="\n") if args.csv else None
    if writer:
        writer.writerow(["path", "rank", "class", "index", "prob", "error"])
    for r in predictor.predict_refs(refs, args.topk, args.batch_size, args.workers):
        failed += "error" in r
        if args.json:
            print(json.dumps(r))
        elif writer:
            rows = [[r["path"], "", "", "", "", r["error"]]] if "error" in r else [
                [r["path"], i + 1, t["class"], t["index"], t["prob"], ""] for i, t in enumerate(r["top"])]
            writer.writerows(rows)
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
        _print_json(args, r)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from vitflow.data.packed import prepare

    meta = prepare(args.src, args.out, args.format, args.max_side, args.quality, args.workers, args.force)
    for name, info in meta["splits"].items():
        print(f"{name}: {info['count']} images ({info['kind']}), {info['skipped']} skipped")
    print(f"packed dataset: {args.out}  (train with data.path={args.out})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from vitflow.infer.export import export_checkpoint

    target = args.target or ("gpu" if torch.cuda.is_available() else "cpu")
    r = export_checkpoint(args.checkpoint, args.output, args.format, args.optimize, target, args.opset,
                          args.verify_data, args.tolerance, fp16=not args.fp32)
    print(f"exported {r['format']} to {r['path']} ({r['bytes'] / 2**20:.1f} MiB, {r['export_s']:.1f} s)")
    if r["fused"]:
        print(f"fused ({target}): " + ", ".join(f"{k} {v}" for k, v in r["fused"].items()))
    print(f"verified on {r['images']} real images: {r['summary']}")
    if args.json:
        _print_json(args, {k: v for k, v in r.items() if k != "summary"})
    return 0 if r["ok"] else 1


def cmd_quantize(args: argparse.Namespace) -> int:
    from vitflow.infer.quantize import AccuracyDropError, quantize_file

    if args.split and not args.data:
        raise ValueError("--split selects images of --data: give --data PATH too (no top-1 is measured without it)")
    try:
        r = quantize_file(args.model, args.output, args.backend, args.dtype, args.data, args.split or "test",
                          args.max_drop, args.force, per_channel=not args.per_tensor)
    except AccuracyDropError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    if "top1_before" in r:
        print(f"top-1 on {r['images']} images: {r['top1_before']:.2%} -> {r['top1_after']:.2%} "
              f"(drop {r['drop_points']:.2f} points, allowed {args.max_drop:g})")
    ops = ", ".join(f"{k} {v}" for k, v in r.get("ops", {}).items())
    print(f"wrote {r['path']} ({r['bytes'] / 2**20:.1f} MiB{'; ' + ops if ops else ''})")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from vitflow.infer.prune import prune_checkpoint

    r = prune_checkpoint(args.checkpoint, args.output, args.heads, args.mlp, args.data, args.calib_images,
                         args.finetune_steps, args.batch_size, args.lr, args.alpha, args.temperature,
                         not args.no_eval, args.eval_split)
    print(f"heads {r['heads_before']} -> {r['heads_after']}, parameters {r['params_before'] / 1e6:.2f} M -> "
          f"{r['params_after'] / 1e6:.2f} M")
    if "top1_before" in r:
        after = f", after fine-tune {r['top1_after']:.2%}" if "top1_after" in r else ""
        print(f"top-1 {r['top1_before']:.2%} unpruned, {r['top1_pruned']:.2%} pruned{after}")
    print(f"speed (fp32 eager, same process): batch-32 throughput x{r['speedup_throughput']:.2f}, "
          f"batch-1 latency x{r['speedup_latency']:.2f} faster")
    print(f"wrote {r['path']}")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "data":
        from vitflow.data.bench import run

        result = run(args.data, args.image_size, args.workers, args.repeats, args.passes, args.batch_size,
                     args.max_side)
        if args.json:
            _print_json(args, result)
        return 0
    import torch

    from vitflow.infer.bench import PATHS, bench_infer, format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    paths = tuple(p.strip() for p in args.paths.split(",")) if args.paths else PATHS
    results, notes = bench_infer(args.checkpoint, paths, args.batch_size, args.repeats, args.latency_calls,
                                 args.min_time, args.attention, log=lambda m: print(m, file=sys.stderr))
    print(f"{args.checkpoint}: {torch.get_num_threads()} threads, batch-1 latency over "
          f"{args.repeats * args.latency_calls} calls, batch-{args.batch_size} throughput median of {args.repeats} "
          f"rounds; ratios are speed-ups over timm_eager_fp32")
    print(format_table(results, notes, args.batch_size))
    if args.json:
        _print_json(args, results)
    return 0


def cmd_lr_schedule(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from vitflow.viz.curves import plot_schedule

    for step, lr in plot_schedule(cfg, args.output):
        print(f"step {step:>7d}  lr {lr:.3e}")
    print(f"wrote {args.output}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from vitflow.viz.report import write_report

    print(f"wrote {write_report(args.run_dir, args.output)}")
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

    names = list_models(args.pattern)
    if not names:
        print(f"error: no model matches {args.pattern!r} (`vitflow models` lists them all)", file=sys.stderr)
        return 2
    for name in names:
        m = MODELS[name]
        print(f"{name:26s} img {m['img_size']:>3}  patch {m['patch_size']:>2}  dim {m['embed_dim']:>4}  "
              f"depth {m['depth']:>2}  heads {m['num_heads']:>2}  mlp {m.get('mlp_ratio', 4.0):g}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "predict": cmd_predict, "attention": cmd_attention,
            "export": cmd_export, "quantize": cmd_quantize, "prune": cmd_prune, "prepare": cmd_prepare,
            "bench": cmd_bench, "lr-schedule": cmd_lr_schedule, "report": cmd_report, "presets": cmd_presets,
            "models": cmd_models}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.WARNING if os.environ.get("RANK", "0") != "0" else args.log_level  # other ranks: warnings only
    logging.basicConfig(level=max(level, logging.INFO), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    vitflow_log, previous = logging.getLogger("vitflow"), logging.getLogger("vitflow").level
    if level != logging.INFO:
        vitflow_log.setLevel(level)  # -v: vitflow's debug lines, not every library's
    json_only = getattr(args, "json", False) and args.command != "predict"  # predict --json: one line per image
    args.json_stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_only else contextlib.nullcontext():
            return COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if args.debug or os.environ.get("VITFLOW_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from vitflow.infer.onnx_model import UnavailableError  # a target this machine cannot serve

        if not isinstance(e, UnavailableError) or args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        vitflow_log.setLevel(previous)
