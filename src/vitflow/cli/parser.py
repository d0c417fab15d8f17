"""The ``vitflow`` argument parser: every command, its arguments and their help (the CLI
reference in the documentation is generated from it)."""

from __future__ import annotations

import argparse
import logging

from vitflow.cli.arguments import (
    checkpoint_choice,
    config_args,
    merge_count,
    positive,
    retime_arg,
    tta_arg,
    verbosity,
    weights_arg,
)
from vitflow.cli.parser_deploy import deployment_commands, serve_command


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``vitflow predict: error: argument --topk: must be >= 1 (got
    0); see vitflow predict --help``), not the usage block first; exit status 2 as argparse's. The
    sub-commands' parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``vitflow`` parser: global options, then one sub-command per task."""
    parser = OneLineParser(prog="vitflow", description="Train, evaluate and deploy Vision Transformers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    verbosity(parser, logging.INFO)
    sub = parser.add_subparsers(dest="command", required=True)
    _training_commands(sub)
    _sweep_command(sub)
    deployment_commands(sub)
    serve_command(sub)
    _data_and_view_commands(sub)
    bench = _bench_commands(sub)
    _listing_commands(sub)
    for name, p in [*sub.choices.items(), *bench.choices.items()]:
        if name != "bench":
            verbosity(p, argparse.SUPPRESS)
    return parser


def _training_commands(sub) -> None:
    """train, resume, eval, predict."""
    p = sub.add_parser("train", help="train a model (default: a small ViT on the embedded digits data)")
    config_args(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel on N local processes (runs torchrun --standalone --nproc-per-node N)")
    retime_arg(p, "not those an earlier run on this machine made (train.retime=true)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.total_steps=500")

    p = sub.add_parser("resume", help="continue an interrupted run with its saved config (overrides applied)")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="data-parallel on N local processes")
    retime_arg(p, "not those the checkpoint recorded: the resumed run is then not promised to be bit-identical "
                    "to an uninterrupted one (train.retime=true)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config keys to change, e.g. train.total_steps=2000")

    p = sub.add_parser("eval", help="evaluate a checkpoint on its test split (--knn K: k-NN top-1 of its frozen features)")
    p.add_argument("checkpoint", help="checkpoint file or run directory (newest checkpoint); with --knn also a "
                   "hub-style model folder, or weights with --model NAME")
    p.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
    weights_arg(p)
    tta_arg(p)
    checkpoint_choice(p)
    _add_knn_args(p)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.path=... data.test_split=test")

    p = sub.add_parser("predict", help="classify images, folders or tars")
    p.add_argument("checkpoint", help="checkpoint file, run directory, or an exported .onnx model")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR", help="image files, folders or .tar archives")
    p.add_argument("--topk", type=positive, default=5, help="classes to show per image (default 5)")
    p.add_argument("--batch-size", type=positive, default=32)
    p.add_argument("--workers", type=int, default=2, help="image decoding threads (default 2)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16: run a PyTorch model with its weights cast to that dtype (fp16 needs CUDA)")
    p.add_argument("--device", default="auto")
    weights_arg(p)
    tta_arg(p)
    checkpoint_choice(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object per image")
    fmt.add_argument("--csv", action="store_true", help="CSV: path,rank,class,index,prob,error (one row per class)")


def _sweep_command(sub) -> None:
    """sweep."""
    p = sub.add_parser("sweep", help="hyperparameter search (Optuna: TPE, median pruning), each trial a run directory")
    p.add_argument("--preset", help="named recipe of every trial (default digits-vit-tiny)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of sections applied over the preset")
    p.add_argument("--space", required=True, metavar="SWEEP.yaml", help="config key -> {type: float|int|categorical, "
                   "low, high, log, step, choices}")
    p.add_argument("--trials", required=True, type=positive, metavar="N", help="finished trials to reach (a re-run "
                   "of the same command continues to N)")
    p.add_argument("--dir", metavar="SWEEP_DIR", help="the sweep folder (default sweeps/<preset>-<space file name>)")
    p.add_argument("--metric", default="val_top1", help="objective: a figure of the run summary (default val_top1; "
                   "val_loss, test_top1, ...), reported at each train.eval_every for pruning")
    p.add_argument("--direction", choices=["maximize", "minimize"], help="default: minimize for *_loss / *_ece, "
                   "else maximize")
    p.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed (default 0)")
    p.add_argument("--prune-after", type=int, default=3, metavar="K", help="trials run to the end before the median "
                   "rule prunes (default 3)")
    g = p.add_argument_group("workers (several commands on one --dir or --storage cooperate)")
    g.add_argument("--workers", type=positive, default=1, metavar="N", help="trials at a time on this machine (N "
                   "processes, the cores split between them; default 1)")
    g.add_argument("--storage", metavar="URL", help="the trials' database, shared by every worker: postgresql://USER:"
                   "PASSWORD@HOST/DB, mysql+pymysql://... (default: sqlite in the sweep folder, for one machine)")
    g.add_argument("--study", default="sweep", metavar="NAME", help="the search's name in --storage (default sweep)")
    g.add_argument("--threads", type=positive, metavar="T", help="each trial's train.threads (default: torch's; "
                   "--workers N: cores // N)")
    g.add_argument("--heartbeat", type=positive, default=10, metavar="S", help="seconds between a running trial's "
                   "heartbeats; a trial silent for 3 of them lost its worker and is failed (default 10)")
    g.add_argument("--retry-failed", type=int, default=1, metavar="K", help="times a trial that lost its worker runs "
                   "again, from its last checkpoint (default 1)")
    p.add_argument("--json", action="store_true", help="end with one JSON line: counts, best trial, files")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="every trial's overrides, e.g. its budget: "
                   "train.total_steps=300 train.eval_every=100 (or train.time_budget=2m)")


def _add_knn_args(p: argparse.ArgumentParser) -> None:
    """``vitflow eval --knn``: a backbone judged by k-NN on its frozen features."""
    g = p.add_argument_group("k-NN on frozen features")
    g.add_argument("--knn", type=positive, metavar="K", help="k-NN top-1 instead: cosine similarity of pooled "
                   "features, the K nearest train images vote with weights exp(sim/0.07) (DINO's protocol; K=20 there)")
    g.add_argument("--data", metavar="PATH", help="--knn: images with a train split and a test or val split "
                   "(default: the run's data)")
    g.add_argument("--model", metavar="NAME", help="--knn: the architecture of plain weights (see `vitflow models`)")
    g.add_argument("--batch-size", type=positive, help="--knn: images per forward pass (default data.eval_batch_size or 256)")


def _data_and_view_commands(sub) -> None:
    """attention, prepare, inspect."""
    p = sub.add_parser("inspect", help="find label issues, leaks and copies across splits, outliers and broken files "
                       "in a dataset: a page, findings.csv/json and fix files for data.exclude / data.relabel")
    p.add_argument("data", help="the images, as data.path takes them (class folders, a tar, a label file, a dataset, a URL)")
    p.add_argument("--model", help="a run directory, checkpoint or model folder whose embeddings find copies and "
                   "outliers and feed the label probes (fast); default: k-fold training inside --time-budget")
    p.add_argument("--time-budget", default="5m", help="the k-fold path's wall-clock budget (default 5m)")
    p.add_argument("--folds", type=int, default=2, help="k of the k-fold path (default 2)")
    p.add_argument("-o", "--output", help="output folder (default inspect-<data name>; an earlier inspect's is "
                   "updated, any other existing folder refused)")
    p.add_argument("--workers", type=int, default=2, help="image decoding threads (default 2)")
    p.add_argument("--label-cut", type=float, metavar="P", help="exclude.txt (and relabel.csv) take a flagged "
                   "training label issue whose given class's probability is below P (default 0.5 / classes, the surest; 1: every one "
                   "confident learning flags)")
    p.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE", help="data.* keys (data.train_split=..., "
                   "data.label_column=...)")
    p.add_argument("--json", action="store_true", help="end with one JSON line: counts per finding and the files")

    p = sub.add_parser("attention", help="draw a checkpoint's attention maps and rollout on an image")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("image", help="an image file")
    p.add_argument("-o", "--output", default="attention.png", help="PNG to write (default attention.png)")
    p.add_argument("--layer", type=int, default=-1, help="block whose per-head maps are drawn (default -1, the last)")
    p.add_argument("--head-fusion", choices=["mean", "max", "min"], default="mean",
                   help="how rollout combines the heads of a layer (default mean)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    p = sub.add_parser("prepare", help="pack a folder, tar, label file, HF dataset or CIFAR batches into a "
                       "memory-mapped dataset")
    p.add_argument("src", help="image folder, .tar of one, single-label label file, Hugging Face dataset or "
                   "Parquet files, or CIFAR-10/100 python batches folder")
    p.add_argument("out", nargs="?", help="output folder (written as OUT.partial, renamed when complete); omitted "
                   "with --stats: measure SRC in place")
    p.add_argument("--format", choices=["auto", "raw", "jpeg", "wds"], default="auto",
                   help="raw uint8 (small fixed-size images) or re-encoded JPEG; auto picks; wds: WebDataset shards")
    p.add_argument("--shard-size", type=int, help="wds: samples a shard (default 1000)")
    p.add_argument("--max-side", type=int, help="jpeg: downscale so the longer side is at most N px")
    p.add_argument("--quality", type=int, default=90, help="jpeg quality (default 90)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset (wds: shard folder) at OUT")
    p.add_argument("--stats", action="store_true", help="measure the per-channel mean and std of the training split "
                   "(OUT's, or SRC's without OUT) in one pass over every image and store them beside the data, keyed "
                   "by the split's content fingerprint, for data.normalize=dataset")
    p.add_argument("--stats-sample", type=positive, metavar="N", help="--stats over a random sample of N images "
                   "instead of all of them")
    p.add_argument("--split", default="train", help="--stats: the split to measure, as data.train_split names it "
                   "(default train; e.g. 'train[:90%%]')")


def _bench_commands(sub):
    """bench data, bench infer, bench resolution; returns the bench sub-parsers."""
    p = sub.add_parser("bench", help="measure throughput against baselines (data, infer) and accuracy against input "
                       "size (resolution)")
    bench = p.add_subparsers(dest="what", required=True)
    b = bench.add_parser("data", help="input pipeline: decode limit, torchvision baseline, vitflow, packed")
    b.add_argument("--data", required=True, help="image folder or tar (class folders, or a flat folder of images), label file, Hugging Face dataset or WebDataset shards")
    b.add_argument("--image-size", type=int, default=224)
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--passes", type=int, help="epochs per repeat (default 3, or 1 for > 20k images)")
    b.add_argument("--batch-size", type=int, help="default 64, or 256 at <= 64 px")
    b.add_argument("--max-side", type=int, help="packed JPEG longer side (default 256)")
    b.add_argument("--compare", action="append", default=[], metavar="PATH",
                   help="another copy of the data (a tar, shards local or remote...) whose vitflow loader runs in the "
                        "same repeats, reported as a ratio to --data's (repeatable)")
    b.add_argument("--json", action="store_true", help="end with one JSON line of images/s")
    b = bench.add_parser("infer", help="inference latency / throughput (and top-1) of every deployment path vs the "
                         "peers (timm eager, ONNX Runtime, OpenVINO)")
    b.add_argument("checkpoint", help="checkpoint file or run directory")
    b.add_argument("--paths", help="comma-separated paths or shell patterns, e.g. 'timm_openvino_*,openvino_int8*' "
                   "(default: all; see the deployment guide's list)")
    b.add_argument("--data", nargs="?", const="", metavar="PATH", help="measure each path's top-1 on this data (its "
                   "test split, else val); --data alone: the checkpoint's own test data")
    b.add_argument("--split", help="split of --data (e.g. 'test[:2000]', a random 2000)")
    b.add_argument("--max-drop", type=float, default=1.0, help="the fastest paths are chosen among those within "
                   "this many top-1 points of fp32 (1.0)")
    b.add_argument("--calibrate", metavar="DATA", help="calibration images of the static INT8 paths (default: the "
                   "checkpoint's training data)")
    b.add_argument("--reference", metavar="CKPT", help="the peers (timm paths) and the ov_best_* yardstick take this "
                   "checkpoint's model, and its fp32 top-1 bounds the drop: e.g. the unpruned model a pruned CHECKPOINT "
                   "came from")
    b.add_argument("--calibration-images", type=positive, default=300, metavar="N", help="(300)")
    b.add_argument("--batch-size", type=int, default=32, help="throughput batch size (32)")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds (3)")
    b.add_argument("--latency-calls", type=int, default=20, help="batch-1 calls per path per round (20)")
    b.add_argument("--min-time", type=float, default=1.0, help="seconds of batch calls per path per round (1)")
    b.add_argument("--attention", help="attention backend of the vitflow eager/compiled paths (default: the checkpoint's)")
    b.add_argument("--token-merge", type=merge_count, metavar="R|auto", help="tokens merged per block on the tome_* "
                   "paths (ToMe); auto: the largest within --max-drop on --data (default: about half the tokens by "
                   "the last block)")
    b.add_argument("--threads", type=int, help="torch and ONNX Runtime threads (default: torch's default)")
    b.add_argument("--json", action="store_true", help="end with one JSON line {path: {latency_ms_p50, ...}}")
    _bench_resolution(bench)
    return bench


def _sizes(text: str) -> list[int]:
    """argparse type: comma-separated input sizes in pixels, each >= 1."""
    return [positive(part.strip()) for part in text.split(",") if part.strip()]


def _bench_resolution(bench) -> None:
    b = bench.add_parser("resolution", help="top-1, images/s and peak memory of a checkpoint at several input sizes "
                         "(position tables resampled as fine-tuning at that size does), table and PNG plot")
    b.add_argument("checkpoint", help="checkpoint file or run directory")
    checkpoint_choice(b)
    b.add_argument("--sizes", type=_sizes, metavar="S1,S2,...", help="input sizes in pixels, e.g. 128,160,192,224,"
                   "256,288 (default: 0.5, 0.75, 1, 1.25 and 1.5 times the trained size, multiples of the patch); a "
                   "size the model cannot take is skipped with its reason")
    b.add_argument("--compare", action="append", default=[], metavar="CHECKPOINT",
                   help="another checkpoint or run measured at the same sizes and drawn on the same plot, e.g. the "
                   "run fine-tuned at a larger size (FixRes) (repeatable)")
    b.add_argument("-o", "--output", default="resolution.png", help="PNG to write (default resolution.png)")
    b.add_argument("--batch-size", type=positive, default=32, help="images per timed forward and in the memory "
                   "measurement (32)")
    b.add_argument("--repeats", type=positive, default=3, help="timing rounds over all sizes (3)")
    b.add_argument("--min-time", type=float, default=1.0, help="seconds of batch calls per size per round (1)")
    b.add_argument("--device", help="where to run (default: the run's train.device)")
    b.add_argument("--threads", type=int, help="torch threads (default: torch's default)")
    weights_arg(b)
    b.add_argument("--json", action="store_true", help="end with one JSON line: {runs: [{rows: [{size, top1, "
                   "images_per_s, peak_memory_mib, ...}], skipped, ...}], plot}")
    b.add_argument("overrides", nargs="*", metavar="key=value", help="as for vitflow eval, e.g. "
                   "data.test_split='test[:2000]' train.precision=fp32")


def _listing_commands(sub) -> None:
    """lr-schedule, report, presets, models."""
    p = sub.add_parser("lr-schedule", help="plot the learning-rate schedule a config will use")
    config_args(p)
    p.add_argument("-o", "--output", default="lr.png", help="PNG to write (default lr.png)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.schedule=restarts")

    p = sub.add_parser("report", help="write PNG curves and one self-contained HTML page for a run")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, config.yaml, eval.json)")
    p.add_argument("-o", "--output", help="HTML file (default RUN_DIR/report.html; PNGs beside it in report/)")
    checkpoint_choice(p)

    p = sub.add_parser("presets", help="list presets, or print one resolved")
    p.add_argument("name", nargs="?")

    p = sub.add_parser("models", help="list model variants")
    p.add_argument("pattern", nargs="?", help="shell pattern, e.g. 'vit_small_*'")
