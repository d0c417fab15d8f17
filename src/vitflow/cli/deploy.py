"""The deployment commands: ``vitflow export`` (ONNX / TensorRT / a hub-style folder),
``vitflow quantize`` (INT8 with an accuracy guard), ``vitflow prune`` (blocks / attention heads / MLP) and
``vitflow merge-tokens`` (token merging with an accuracy guard)."""

from __future__ import annotations

import argparse
import sys

from vitflow.cli.outputs import chosen
from vitflow.cli.outputs import print_json as _print_json
from vitflow.metrics import TASKS, primary_metric


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from vitflow.infer.export.formats import export_checkpoint
    from vitflow.infer.tta import check_export_tta

    check_export_tta(args.tta, args.format)
    args.checkpoint = chosen(args)
    if args.format == "hub":
        return _export_hub(args)
    if args.format == "triton":
        return _export_triton(args)
    target = args.target or ("gpu" if torch.cuda.is_available() else "cpu")
    r = export_checkpoint(args.checkpoint, args.output, args.format, args.optimize, target, args.opset,
                          args.verify_data, args.tolerance, fp16=not args.fp32, tta=args.tta, batch=args.batch)
    print(f"exported {r['format']} to {r['path']} ({r['bytes'] / 2**20:.1f} MiB, {r['export_s']:.1f} s)")
    if r["fused"]:
        print(f"fused ({target}): " + ", ".join(f"{k} {v}" for k, v in r["fused"].items()))
    print(f"verified on {r['images']} real images{' with TTA ' + args.tta if args.tta else ''}: {r['summary']}")
    if args.json:
        _print_json(args, {k: v for k, v in r.items() if k != "summary"})
    return 0 if r["ok"] else 1


def _export_hub(args: argparse.Namespace) -> int:
    """``vitflow export RUN --format hub -o DIR``: a hub-style folder timm and vitflow load."""
    from vitflow.infer.export.hub_folder import save_hub_folder

    r = save_hub_folder(args.checkpoint, args.output)
    print(f"wrote {r['path']}: {', '.join(r['files'])} ({r['bytes'] / 2**20:.1f} MiB, timm architecture "
          f"{r['architecture']}); read back: max |logit diff| {r['max_abs_diff']:.1e}")
    print(f"load it: timm.create_model(\"local-dir:{r['path']}\", pretrained=True)")
    if args.json:
        _print_json(args, r)
    return 0


def _export_triton(args: argparse.Namespace) -> int:
    """``vitflow export RUN --format triton -o REPO``: a Triton model repository."""
    import torch

    from vitflow.infer.serve.triton import write_triton_repository

    r = write_triton_repository(args.checkpoint, args.output, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                                optimize=args.optimize, target=args.target or "cpu", opset=args.opset,
                                verify_data=args.verify_data, tolerance=args.tolerance,
                                kind="KIND_GPU" if args.target == "gpu" and torch.cuda.is_available() else "KIND_CPU")
    print(f"wrote Triton model repository {r['repository']}: model {r['model']} ({r['config']}, labels.txt, "
          f"1/model.onnx {r['bytes'] / 2**20:.1f} MiB)")
    print(f"dynamic batching (read back): {r['dynamic_batching']}; verified on {r['images']} real images: "
          f"{r['summary']}")
    print(f"serve it: tritonserver --model-repository {r['repository']}")
    if args.json:
        _print_json(args, {k: v for k, v in r.items() if k != "summary"})
    return 0 if r["ok"] else 1


def cmd_quantize(args: argparse.Namespace) -> int:
    from vitflow.infer.quantize.dynamic import quantize_file
    from vitflow.infer.quantize.guard import AccuracyDropError
    from vitflow.infer.quantize.static import METHODS

    if args.split and not args.data:
        raise ValueError("--split selects images of --data: give --data PATH too (without --data the guard measures "
                         "the checkpoint's own test split)")
    calibrated = args.calibrate is not None or args.backend == "openvino"
    if not calibrated and (args.method or args.batch):
        raise ValueError("--method and --batch go with --calibrate (static INT8) or --backend openvino")
    try:
        r = quantize_file(args.model, args.output, args.backend, args.dtype, args.data, args.split,
                          args.max_drop, args.force, per_channel=not args.per_tensor, calibrate=calibrated,
                          calibration=args.calibrate or None, methods=tuple(args.method or METHODS),
                          images=args.calibration_images, batch=args.batch)
    except AccuracyDropError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    for figure, name in ((m.name, m.label) for m in map(primary_metric, TASKS)):  # top-1, mAP
        if f"{figure}_before" in r:
            print(f"{name} on {r['images']} images: {r[f'{figure}_before']:.2%} -> {r[f'{figure}_after']:.2%} "
                  f"(drop {r['drop_points']:.2f} points, allowed {args.max_drop:g})")
    if "method" in r:
        tried = ", ".join(f"{m} {v:.2%}" if v is not None else m for m, v in r["methods"].items())
        print(f"calibrated on {r['calibration_images']} images; kept {r['method']} ({tried})")
    ops = ", ".join(f"{k} {v}" for k, v in r.get("ops", {}).items())
    print(f"wrote {r['path']} ({r['bytes'] / 2**20:.1f} MiB{'; ' + ops if ops else ''})")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from vitflow.infer.prune import prune_checkpoint
    from vitflow.training.objectives.distill import distill_finetune

    r = prune_checkpoint(args.checkpoint, args.output, args.heads, args.mlp, args.blocks, args.data, args.calib_images,
                         args.finetune_steps, args.batch_size, args.lr, args.alpha, args.temperature,
                         not args.no_eval, args.eval_split, log=_progress(args), finetune=distill_finetune)
    blocks = f"blocks {r['depth'] + len(r['blocks_removed'])} -> {r['depth']}, " if r["blocks_removed"] else ""
    print(f"{blocks}heads {r['heads_before']} -> {r['heads_after']}, parameters {r['params_before'] / 1e6:.2f} M -> "
          f"{r['params_after'] / 1e6:.2f} M")
    if "top1_before" in r:
        after = f", after fine-tune {r['top1_after']:.2%}" if "top1_after" in r else ""
        print(f"top-1 {r['top1_before']:.2%} as given, {r['top1_pruned']:.2%} pruned{after}")
    return _speed_and_output(args, r)


def cmd_merge_tokens(args: argparse.Namespace) -> int:
    from vitflow.infer.token_merge import merge_checkpoint

    r = merge_checkpoint(args.checkpoint, args.output, args.r, args.max_drop, args.data, args.split,
                         log=_progress(args))
    name = "top-1" if r["figure"] == "top1" else r["figure"]
    allowed = f", allowed {args.max_drop:g}" if args.r == "auto" else ", -r given: not checked against --max-drop"
    print(f"r={r['r']} tokens merged per block ({r['schedule']}): {name} {r['before']:.2%} -> {r['after']:.2%} "
          f"(drop {r['drop_points']:.2f} points on {r['images']} images{allowed})")
    return _speed_and_output(args, r)


def _progress(args: argparse.Namespace):
    """Where a long command's progress lines go: stderr (stdout keeps the results), nowhere under ``-q``."""
    from vitflow.runtime import quiet

    return (lambda message: None) if quiet() else (lambda message: print(message, file=sys.stderr))


def _speed_and_output(args: argparse.Namespace, r: dict) -> int:
    """The side-by-side fp32 speed-ups of a rewritten checkpoint, where it was written, and the JSON line."""
    print(f"speed against the original (fp32 eager, timed side by side in this process; above 1 is faster): "
          f"batch-32 throughput x{r['speedup_throughput']:.2f}, batch-1 latency x{r['speedup_latency']:.2f}")
    print(f"wrote {r['path']}")
    if args.json:
        _print_json(args, r)
    return 0
