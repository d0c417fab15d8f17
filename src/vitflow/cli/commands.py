"""The commands: each parses nothing, builds the config if it has one, calls one layer and
prints its result."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import signal
import sys
import time

from vitflow.cli.deploy import cmd_export, cmd_merge_tokens, cmd_prune, cmd_quantize
from vitflow.cli.outputs import chosen, escaped, live_report_hook, train_epilogue
from vitflow.cli.outputs import print_json as _print_json
from vitflow.cli.serve import cmd_serve
from vitflow.config import build_config, list_presets, preset_tree, to_yaml
from vitflow.data.sources.readers import display_name
from vitflow.models import config_class
from vitflow.rundir import run_of_checkpoint, write_eval_record
from vitflow.training.checks import CONFIG_CHECKS


def cmd_train(args: argparse.Namespace) -> int:
    from vitflow.training.configure import training_config

    cfg = training_config(args.preset, args.config, args.overrides, CONFIG_CHECKS)
    if args.print_config:
        from vitflow.models.pretrained.config import apply_pretrained

        cfg.model, _ = apply_pretrained(cfg.model, cfg.data, cfg.key_origins)  # as training takes them
        print(to_yaml(cfg), end="")
        if cfg.data.path and not os.path.exists(cfg.data.path):  # shown, but training would stop here
            print(f"warning: data.path {cfg.data.path} does not exist", file=sys.stderr)
        return 0
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:  # become torchrun; it starts the N ranks
        from vitflow.training.scale.distributed import torchrun_command

        argv = (["--debug"] if args.debug else []) + {logging.DEBUG: ["-v"], logging.WARNING: ["-q"]}.get(
            args.log_level, []) + ["train"] + (["--preset", args.preset] if args.preset else []) + (
            ["--config", args.config] if args.config else []) + (["--json"] if args.json else []) + args.overrides
        cmd = torchrun_command(args.nproc, argv)
        os.execv(cmd[0], cmd)
    from vitflow.evaluation import split_results
    from vitflow.metrics import headline
    from vitflow.training import train
    from vitflow.training.run.guards import NonFiniteError

    try:
        r = train(cfg, on_eval=live_report_hook(cfg.train.live_report))
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports
        return 0
    if "interrupted" in r:
        print(f"{r['interrupted']}: stopped at step {r['step']}; checkpoint: {r['checkpoint']}\n"
              f"continue with: vitflow resume {r['run_dir']}")
        if args.json:
            _print_json(args, r)
        return 128 + int(signal.Signals[r["interrupted"]])  # SIGTERM 143, SIGINT 130, SIGUSR1 138
    by_split = split_results(r)
    for role, result in by_split.items():
        print(f"{role} {headline(result)}")
    print(f"({r['step']} steps, {r['elapsed_s']:.0f} s, {r['train_images_per_s']:.0f} img/s)")
    if r.get("race"):
        print(f"race: {r['race']['winner']} won ({r['race']['why']}); the candidates: {r['run_dir']}/race")
    held_out = sum(result.get("skipped", 0) for result in by_split.values())
    if r["skipped_images"] or held_out:
        print(f"skipped unreadable images: {r['skipped_images']} in training, {held_out} in the final "
              "evaluations; see the warnings above")
    print(f"run directory: {r['run_dir']}\ncheckpoint: {r['checkpoint']}")
    train_epilogue(r, cfg.train.live_report)
    if args.json:
        _print_json(args, r)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """``vitflow resume RUN [key=value ...]``: ``vitflow train train.resume=auto train.run_dir=RUN``."""
    args.overrides = ["train.resume=auto", f"train.run_dir={args.run_dir}", *args.overrides]
    args.preset = args.config = None
    args.print_config = False
    return cmd_train(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    """``vitflow sweep``: :func:`vitflow.training.sweep.run_sweep`."""
    from vitflow.training.sweep import SweepInterrupted, run_sweep

    try:
        r = run_sweep(args.space, args.trials, args.dir, args.preset, args.config, args.overrides, args.metric,
                      args.direction, args.seed, args.prune_after, CONFIG_CHECKS, storage=args.storage,
                      study=args.study, workers=args.workers, threads=args.threads, heartbeat=args.heartbeat,
                      retry_failed=args.retry_failed)
    except SweepInterrupted as e:
        print(f"{e}; continue the sweep with the same command", file=sys.stderr)
        return 130
    best = r["best"]
    print(f"{r['trials']} trials ({r['complete']} complete, {r['pruned']} pruned, {r['failed']} failed): {r['table']}")
    if best:
        print(f"best: trial {best['trial']}, {r['metric']} {best['value']:.4g} ({best['run_dir']}); config: "
              f"{r['best_config']}")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from vitflow.evaluation import split_results
    from vitflow.infer.evaluate import evaluate_checkpoint
    from vitflow.metrics import headline
    from vitflow.metrics.classification import per_class_text

    if args.knn:
        return _eval_knn(args)
    if args.model or args.data or args.batch_size:
        raise ValueError("--model, --data and --batch-size go with --knn K (for a plain evaluation on other data "
                         "use data.path=...)")
    r = evaluate_checkpoint(chosen(args), args.overrides, weights=args.weights, tta=args.tta)
    role = r["split"]
    result = split_results(r)[role]
    tta = f", TTA {r['tta']}" if r["tta"] != "none" else ""
    print(f"{role} {headline(result)}  ({result['images']} images of {r['split_expr']} at {r['image_size']} px, "
          f"{r['weights']} weights{tta}, {r['images_per_s']:.0f} images/s, {r['checkpoint']})")
    if "f1" in result:  # single-label: the per-class table
        print(per_class_text(r["classes"], result))
    if (run := run_of_checkpoint(r["checkpoint"])) is not None:  # the run report shows it
        kept = {k: r[k] for k in ("step", "split_expr", "weights", "classes", "checkpoint", "tta")}
        path = write_eval_record(run, {**kept, **result, "split": role, "source": "vitflow eval", "time": time.time(),
                                       "task": "multilabel" if "map" in result else "multiclass"})
        print(f"recorded for the run's report: {path}")
    return _skipped_and_json(args, r, result["skipped"])


def _eval_knn(args: argparse.Namespace) -> int:
    """``vitflow eval MODEL --knn K``: k-NN top-1 of frozen features (train split as the memory bank)."""
    from vitflow.infer.features.embed import knn_evaluate

    r = knn_evaluate(args.checkpoint, args.knn, args.data, args.overrides, args.model, args.weights, args.batch_size)
    print(f"{r['split']} k-NN top-1 {r['knn_top1']:.2%}  (k={r['knn_k']}, T={r['knn_temperature']:g}, cosine on "
          f"{r['feature_dim']}-d features; {r['images']} images of {r['split_expr']} against {r['train_images']} "
          f"of {r['train_split']}; {r['model']})")
    return _skipped_and_json(args, r, r["skipped"])


def _skipped_and_json(args: argparse.Namespace, r: dict, skipped: int) -> int:
    """The end of an evaluation's output: the count of unreadable images, then the ``--json`` line."""
    if skipped:
        print(f"skipped {skipped} unreadable image(s); see the warnings above")
    if args.json:
        _print_json(args, r)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from vitflow.api.quality import inspect

    bad = [o for o in args.overrides if not o.startswith("data.") or "=" not in o]
    if bad:
        print(f"error: {bad[0]}: inspect takes data.KEY=VALUE overrides only", file=sys.stderr)
        return 2
    df = inspect(args.data, args.model, args.time_budget, args.output, args.folds, workers=args.workers,
                 label_cut=args.label_cut, **dict(o.split("=", 1) for o in args.overrides))
    summary, files = df.attrs["summary"], df.attrs["files"]
    counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in summary["findings"].items()) or "no findings"
    print(f"{sum(summary['images'].values())} images in {len(summary['images'])} split(s): {counts} "
          f"({summary['seconds']:.0f} s)\npage: {files['page']}\nfindings: {files['findings.csv']}\n"
          f"fixes: vitflow train ... data.exclude={files['exclude.txt']} (and data.relabel={files['relabel.csv']} "
          "to relabel its surest label issues instead of dropping them)")
    if args.json:
        _print_json(args, {"images": summary["images"], "findings": summary["findings"], "seconds": summary["seconds"],
                           **{k.replace(".", "_"): v for k, v in files.items()}})
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    from vitflow.infer import collect_images
    from vitflow.infer.features.backbone import load_backbone
    from vitflow.infer.features.embed import embed_images, write_features

    backbone = load_backbone(args.model, args.model_name, args.weights)
    refs = collect_images(args.inputs)
    if not refs:
        raise FileNotFoundError(f"no images found in {' '.join(args.inputs)}")
    feats, paths = embed_images(backbone, refs, args.batch_size, args.workers, args.device)
    files = write_features(feats, paths, args.output)
    print(f"embedded {len(paths)} of {len(refs)} image(s): {feats.shape[1]}-d features -> {files['features']}, "
          f"paths -> {files['paths']}")
    if len(paths) < len(refs):
        print(f"skipped {len(refs) - len(paths)} unreadable image(s); see the warnings above", file=sys.stderr)
    if args.json:
        _print_json(args, {"count": len(paths), "dim": int(feats.shape[1]), "skipped": len(refs) - len(paths),
                           **files})
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from vitflow.infer import Predictor, collect_images

    predictor = Predictor.load(chosen(args), args.device, args.precision, args.weights)
    predictor.set_tta(args.tta)
    refs = collect_images(args.inputs)
    if not refs:
        raise FileNotFoundError(f"no images found in {' '.join(args.inputs)}")
    failed = 0
    writer = csv.writer(sys.stdout, lineterminator="\n") if args.csv else None
    if writer:
        writer.writerow(["path", "rank", "class", "index", "prob", "error"])
    for r in predictor.predict_refs(refs, args.topk, args.batch_size, args.workers):
        failed += "error" in r
        if args.json or writer:  # valid UTF-8: a name's bytes that are not UTF-8 as \xNN (escaped)
            r = escaped(r)
        if args.json:
            print(json.dumps(r))
        elif writer:
            rows = [[r["path"], "", "", "", "", r["error"]]] if "error" in r else [
                [r["path"], i + 1, t["class"], t["index"], t["prob"], ""] for i, t in enumerate(r["top"])]
            writer.writerows(rows)
        elif "error" in r:
            print(f"{display_name(r['path'])}: ERROR {display_name(r['error'])}", file=sys.stderr)
        else:
            shown = r.get("labels", r["top"])
            print(f"{display_name(r['path'])}: " + (", ".join(f"{display_name(t['class'])} {t['prob']:.1%}"
                                                             for t in shown) or "no label over the threshold "
                                                    f"{predictor.threshold:.2f}"))
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
    from vitflow.config import DataConfig
    from vitflow.data.prepare import prepare
    from vitflow.data.stats.store import measure_split

    if args.out is None and not args.stats:
        raise ValueError("vitflow prepare: give OUT, the packed dataset to write (or --stats alone to measure SRC's "
                         "statistics in place)")
    if args.stats_sample is not None and not args.stats:
        raise ValueError("--stats-sample N goes with --stats")
    workers = args.workers or os.cpu_count() or 1
    if args.out is not None:
        meta = prepare(args.src, args.out, args.format, args.max_side, args.quality, workers, args.force,
                       args.shard_size)
        for name, info in meta["splits"].items():
            print(f"{name}: {info['count']} images ({info['kind']}), {info['skipped']} skipped")
        what = "WebDataset shards" if args.format == "wds" else "packed dataset"
        print(f"{what}: {args.out}  (train with data.path={args.out})")
    if args.stats:
        data = DataConfig(path=args.out or args.src, train_split=args.split)
        stats, fingerprint, file = measure_split(data, args.stats_sample, workers)
        print(f"{args.split}: {stats.describe()} ({stats.seconds:.1f} s, fingerprint {fingerprint})")
        print(f"statistics: {file}  (train with data.path={data.path} data.normalize=dataset)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "data":
        from vitflow.data.bench import run

        result = run(args.data, args.image_size, args.workers, args.repeats, args.passes, args.batch_size,
                     args.max_side, compare=args.compare)
        if args.json:
            _print_json(args, result)
        return 0
    if args.what == "resolution":
        return _bench_resolution(args)
    import torch

    from vitflow.infer.bench.infer import bench_infer, format_table, select_paths

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.split and not args.data:
        raise ValueError("--split selects images of --data: give --data PATH too")
    r = bench_infer(args.checkpoint, select_paths(args.paths), args.batch_size, args.repeats, args.latency_calls,
                    args.min_time, args.attention, log=lambda m: print(m, file=sys.stderr), data=args.data,
                    split=args.split, calibrate=args.calibrate, calibration_count=args.calibration_images,
                    reference=args.reference, token_merge=args.token_merge, max_drop=args.max_drop)
    if c := r["token_merge"]:
        print(f"token merging: r={c['r']} chosen (the largest within {c['max_drop']:g} {c['figure']} points of "
              f"{c['before']:.2%} on {c['images']} images; tried " +
              ", ".join(f"r={x['r']} {x['value']:.2%}" for x in c["curve"]) + ")")
    print(f"{args.checkpoint}: {torch.get_num_threads()} threads, batch-1 latency over "
          f"{args.repeats * args.latency_calls} calls, batch-{args.batch_size} throughput median of {args.repeats} "
          f"rounds; ratios are speed-ups over timm_eager_fp32")
    print(format_table(r, args.batch_size, args.max_drop))
    if args.json:
        _print_json(args, r["results"])
    return 0


def _bench_resolution(args: argparse.Namespace) -> int:
    """``vitflow bench resolution``: :func:`vitflow.infer.bench.resolution.bench_resolution` of the checkpoint
    and each ``--compare``, their tables, one plot."""
    import torch

    from vitflow.infer.bench.resolution import bench_resolution, format_table
    from vitflow.viz.resolution import plot_resolution

    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for path in [chosen(args), *args.compare]:
        r = bench_resolution(path, args.sizes, args.overrides, args.weights, args.batch_size, args.repeats,
                             args.min_time, args.device, say=lambda m: print(m, file=sys.stderr))
        print(f"{r['checkpoint']} (step {r['step']}, {r['model']} trained at {r['trained_size']} px): top-1 on "
              f"{r['split_expr']} ({r['weights']} weights); images/s at batch {r['batch_size']}, median of "
              f"{args.repeats} rounds, {r['device']} {r['precision']}, {r['threads']} threads")
        print(format_table(r))
        runs.append(r)
    plot = plot_resolution(runs, args.output)
    print(f"plot: {plot}")
    if args.json:
        _print_json(args, {"runs": runs, "plot": str(plot)})
    return 0


def cmd_lr_schedule(args: argparse.Namespace) -> int:
    cfg = build_config(args.preset, args.config, args.overrides, checks=CONFIG_CHECKS, model_config=config_class)
    if args.print_config:
        from vitflow.models.pretrained.config import apply_pretrained

        cfg.model, _ = apply_pretrained(cfg.model, cfg.data, cfg.key_origins)  # as training takes them
        print(to_yaml(cfg), end="")
        return 0
    from vitflow.models import model_kwargs
    from vitflow.training.optim.schedules import lr_curve
    from vitflow.viz.curves import plot_schedule

    restart = cfg.finetune.probe_end(cfg.train.total_steps) if cfg.finetune.mode == "lp_ft" else 0
    kw = model_kwargs(cfg.model.name)
    depth = kw.get("depth") or sum(kw.get("depths", ()))  # (Swin: blocks over all stages)
    curve = lr_curve(cfg.optim, cfg.train.total_steps, depth, cfg.train.time_budget, restart)
    plot_schedule(curve.lrs, args.output, curve.title, curve.lowest_scale)
    for step, lr in curve.landmarks():
        print(f"step {step:>7d}  lr {lr:.3e}")
    print(f"wrote {args.output}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from vitflow.viz.report import write_report

    checkpoint = None if args.which in (None, "last") else chosen(argparse.Namespace(checkpoint=args.run_dir,
                                                                                   which=args.which))
    print(f"wrote {write_report(args.run_dir, args.output, checkpoint)}")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    if args.name:
        preset_tree(args.name)  # fails with the nearest names if unknown
        checks = {k: v for k, v in CONFIG_CHECKS.items() if k != "model"}  # model.name=auto needs the weights
        print(to_yaml(build_config(args.name, checks=checks, model_config=config_class)), end="")
        return 0
    for name, desc in list_presets().items():
        print(f"{name:28s} {desc}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from vitflow.models import FAMILIES, list_models

    if not list_models(args.pattern):
        print(f"error: no model matches {args.pattern!r} (`vitflow models` lists them all)", file=sys.stderr)
        return 2
    for family in FAMILIES:
        names = list_models(args.pattern, family.name)
        if names:
            print(f"{family.name}: {family.description}")
            for name in names:
                print(f"  {name:32s} {family.summary(family.variants[name])}")
    return 0


COMMANDS = {"train": cmd_train, "resume": cmd_resume, "eval": cmd_eval, "predict": cmd_predict, "attention": cmd_attention,
            "embed": cmd_embed, "inspect": cmd_inspect,
            "export": cmd_export, "serve": cmd_serve, "quantize": cmd_quantize, "prune": cmd_prune,
            "merge-tokens": cmd_merge_tokens, "prepare": cmd_prepare,
            "bench": cmd_bench, "lr-schedule": cmd_lr_schedule, "report": cmd_report, "presets": cmd_presets,
            "models": cmd_models,
            "sweep": cmd_sweep}
