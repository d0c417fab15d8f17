"""The ``vitflow`` argument parser: every command, its arguments and their help (the CLI
reference in the documentation is generated from it)."""

from __future__ import annotations

import argparse
import logging


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="named recipe (see `vitflow presets`); default digits-vit-tiny")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of sections applied over the preset")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="auto: the EMA weights when the checkpoint has them (default), else the trained ones")


def _add_checkpoint_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", dest="which", metavar="best|last|PATH",
                   help="which checkpoint of a run directory: last (the newest, default), best (train.keep_best's "
                   "checkpoints/best.pt) or a file")


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


def build_parser() -> argparse.ArgumentParser:
    """The ``vitflow`` parser: global options, then one sub-command per task."""
    parser = argparse.ArgumentParser(prog="vitflow", description="Train, evaluate and deploy Vision Transformers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    _add_verbosity(parser, logging.INFO)
    sub = parser.add_subparsers(dest="command", required=True)
    _training_commands(sub)
    _sweep_command(sub)
    _deployment_commands(sub)
    _serve_command(sub)
    _data_and_view_commands(sub)
    bench = _bench_commands(sub)
    _listing_commands(sub)
    for name, p in [*sub.choices.items(), *bench.choices.items()]:
        if name != "bench":
            _add_verbosity(p, argparse.SUPPRESS)
    return parser


def _training_commands(sub) -> None:
    """train, resume, eval, predict."""
    p = sub.add_parser("train", help="train a model (default: a small ViT on the embedded digits data)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel on N local processes (runs torchrun --standalone --nproc-per-node N)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.total_steps=500")

    p = sub.add_parser("resume", help="continue an interrupted run with its saved config (overrides applied)")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--json", action="store_true", help="end with one JSON line of final metrics")
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="data-parallel on N local processes")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config keys to change, e.g. train.total_steps=2000")

    p = sub.add_parser("eval", help="evaluate a checkpoint on its test split (--knn K: k-NN top-1 of its frozen features)")
    p.add_argument("checkpoint", help="checkpoint file or run directory (newest checkpoint); with --knn also a "
                   "hub-style model folder, or weights with --model NAME")
    p.add_argument("--json", action="store_true", help="end with one JSON line of metrics")
    _add_weights_arg(p)
    _add_tta_arg(p)
    _add_checkpoint_choice(p)
    _add_knn_args(p)
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
    _add_tta_arg(p)
    _add_checkpoint_choice(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object per image")
    fmt.add_argument("--csv", action="store_true", help="CSV: path,rank,class,index,prob,error (one row per class)")


def _add_tta_arg(p: argparse.ArgumentParser, what: str = "average the probabilities over test-time views") -> None:
    p.add_argument("--tta", metavar="SPEC", help=f"{what}: flip, crops5, scales=S1,S2,... (last), comma-joined, "
                   "e.g. flip,crops5 (10 views); default none")


def _sweep_command(sub) -> None:
    """sweep."""
    p = sub.add_parser("sweep", help="hyperparameter search (Optuna: TPE, median pruning), each trial a run directory")
    p.add_argument("--preset", help="named recipe of every trial (default digits-vit-tiny)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of sections applied over the preset")
    p.add_argument("--space", required=True, metavar="SWEEP.yaml", help="config key -> {type: float|int|categorical, "
                   "low, high, log, step, choices}")
    p.add_argument("--trials", required=True, type=_positive, metavar="N", help="finished trials to reach (a re-run "
                   "of the same command continues to N)")
    p.add_argument("--dir", metavar="SWEEP_DIR", help="the sweep folder (default sweeps/<preset>-<space file name>)")
    p.add_argument("--metric", default="val_top1", help="objective: a figure of the run summary (default val_top1; "
                   "val_loss, test_top1, ...), reported at each train.eval_every for pruning")
    p.add_argument("--direction", choices=["maximize", "minimize"], help="default: minimize for *_loss / *_ece, "
                   "else maximize")
    p.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed (default 0)")
    p.add_argument("--prune-after", type=int, default=3, metavar="K", help="trials run to the end before the median "
                   "rule prunes (default 3)")
    p.add_argument("--json", action="store_true", help="end with one JSON line: counts, best trial, files")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="every trial's overrides, e.g. its budget: "
                   "train.total_steps=300 train.eval_every=100 (or train.time_budget=2m)")


def _add_knn_args(p: argparse.ArgumentParser) -> None:
    """``vitflow eval --knn``: a backbone judged by k-NN on its frozen features."""
    g = p.add_argument_group("k-NN on frozen features")
    g.add_argument("--knn", type=_positive, metavar="K", help="k-NN top-1 instead: cosine similarity of pooled "
                   "features, the K nearest train images vote with weights exp(sim/0.07) (DINO's protocol; K=20 there)")
    g.add_argument("--data", metavar="PATH", help="--knn: images with a train split and a test or val split "
                   "(default: the run's data)")
    g.add_argument("--model", metavar="NAME", help="--knn: the architecture of plain weights (see `vitflow models`)")
    g.add_argument("--batch-size", type=_positive, help="--knn: images per forward pass (default data.eval_batch_size or 256)")


def _add_embed_command(sub) -> None:
    p = sub.add_parser("embed", help="pooled features of images, folders or tars, written as .npy with their paths")
    p.add_argument("model", help="run directory, checkpoint, hub-style model folder, or weights with --model NAME")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR", help="image files, folders or .tar archives")
    p.add_argument("-o", "--output", required=True, metavar="FEATURES.npy",
                   help="float32 (N, D) features; the N image paths go beside it, one per line: FEATURES.paths.txt")
    p.add_argument("--model", dest="model_name", metavar="NAME", help="the architecture of plain weights "
                   "(create_model(NAME, pretrained=MODEL, num_classes=0))")
    p.add_argument("--batch-size", type=_positive, default=32)
    p.add_argument("--workers", type=int, default=2, help="image decoding threads (default 2)")
    p.add_argument("--device", default="auto")
    _add_weights_arg(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line: count, dim, output paths")


def _deployment_commands(sub) -> None:
    """export, quantize, prune."""
    _add_embed_command(sub)
    p = sub.add_parser("export", help="export a checkpoint (ONNX, TorchScript, ExportedProgram, TensorRT, hub-style "
                       "folder), verified")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    _add_checkpoint_choice(p)
    p.add_argument("--format", default="onnx", choices=["onnx", "torchscript", "exported-program", "tensorrt", "hub",
                                                       "triton"],
                   help="hub: a new folder of config.json, model.safetensors (timm names) and README.md (model card) "
                   "that timm and vitflow load; triton: a new Triton model repository (config.pbtxt with dynamic "
                   "batching, labels.txt, 1/model.onnx)")
    p.add_argument("--max-batch", type=_positive, default=16, help="triton: max_batch_size (16)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="triton: dynamic batching's max queue delay in ms (5)")
    p.add_argument("-o", "--output", required=True, help="output file (.onnx, .ts, .pt2, .engine) or, for hub and "
                   "triton, a new (or empty) folder")
    p.add_argument("--optimize", action="store_true", help="ONNX: apply ONNX Runtime's transformer fusions")
    p.add_argument("--target", choices=["cpu", "gpu"], help="--optimize for this target (default: gpu if CUDA "
                   "is available, else cpu)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset (18 or newer; default 18); one the exporter cannot write is refused")
    p.add_argument("--verify-data", metavar="PATH", help="real images (file, folder or tar) to verify on; "
                   "default: the checkpoint's test split")
    p.add_argument("--tolerance", type=float, help="max |logit difference| (default 1e-4; 0.1 for FP16 TensorRT)")
    _add_tta_arg(p, "ONNX: average the probabilities of these views inside the graph (its output becomes their "
                 "log; use flip and/or crops5)")
    p.add_argument("--fp32", action="store_true", help="TensorRT: build an FP32 engine (default FP16)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    p = sub.add_parser("quantize", help="INT8 (ONNX Runtime or PyTorch) or FP16/BF16 weights, with an accuracy guard")
    p.add_argument("model", help="checkpoint, run directory, or a vitflow .onnx model (onnxruntime backend)")
    p.add_argument("-o", "--output", required=True, help="output: .onnx (onnxruntime) or .pt (torch)")
    p.add_argument("--backend", choices=["onnxruntime", "torch"], default="onnxruntime")
    p.add_argument("--dtype", choices=["int8", "fp16", "bf16"], default="int8",
                   help="int8 (default); fp16/bf16 weight casting for GPU inference (torch backend)")
    p.add_argument("--data", metavar="PATH",
                   help="data to measure top-1 (multi-label models: mAP) on before and after: a folder, tar, "
                   "label file or dataset")
    p.add_argument("--split", help="split of --data (default test; e.g. 'test[:2000]')")
    p.add_argument("--max-drop", type=float, default=1.0, help="max top-1 (mAP) drop in points (default 1.0)")
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


def _serve_command(sub) -> None:
    """serve (vitflow.cli.serve runs it)."""
    p = sub.add_parser("serve", help="serve a model over HTTP with dynamic batching (uvicorn workers or Ray Serve)")
    p.add_argument("checkpoint", metavar="SOURCE", help="run directory (newest checkpoint), checkpoint, hub-style "
                   "folder, or an exported .onnx / INT8 .onnx model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=_positive, default=16, help="images in one model call, at most (16)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long the first image of a batch waits for "
                   "more, in ms (5)")
    p.add_argument("--max-queue", type=_positive, default=64, help="images held (decoding, queued, running) before "
                   "new requests get 503 with Retry-After (64)")
    p.add_argument("--timeout", type=float, default=30.0, help="a request's deadline in seconds: 408 while its body "
                   "is still arriving, else 504 (30)")
    p.add_argument("--workers", type=_positive, default=1, help="server processes, each with its own model and "
                   "batcher; one that dies is restarted (1)")
    p.add_argument("--threads", type=int, default=0, help="PyTorch / ONNX Runtime threads per worker (default: "
                   "the cores divided by the workers)")
    p.add_argument("--decode-threads", type=_positive, default=2, help="decoding threads per worker (2)")
    p.add_argument("--backend", default="auto", choices=["auto", "eager_fp32", "eager_bf16", "onnxruntime"],
                   help="auto (default): the fastest fp32 path measured at start-up (eager_fp32 or onnxruntime; "
                   "eager_bf16 too on CPUs with native bf16); an .onnx source runs on onnxruntime")
    p.add_argument("--device", default="auto")
    _add_weights_arg(p)
    _add_tta_arg(p)
    _add_checkpoint_choice(p)
    p.add_argument("--max-body-bytes", type=_positive, default=20 * 2**20, help="request body limit (20 MiB)")
    p.add_argument("--max-pixels", type=_positive, default=40_000_000, help="pixels of one image (40 M)")
    p.add_argument("--max-images", type=_positive, default=32, help="images in one request (32)")
    p.add_argument("--topk", type=_positive, default=5, help="classes per image unless the request asks ?top_k= (5)")
    p.add_argument("--name", help="the model's name in answers (default: the source's file or folder name)")
    p.add_argument("--log-json", action="store_true", help="request log lines as JSON objects")
    p.add_argument("--ray", action="store_true", help="deploy on Ray Serve (RAY_ADDRESS, or a local Ray instance)")
    p.add_argument("--replicas", type=_positive, default=1, help="--ray: replicas, each with its own batcher (1)")


def _data_and_view_commands(sub) -> None:
    """attention, prepare."""
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
    p.add_argument("out", help="output folder (written as OUT.partial, renamed when complete)")
    p.add_argument("--format", choices=["auto", "raw", "jpeg", "wds"], default="auto",
                   help="raw uint8 (small fixed-size images) or re-encoded JPEG; auto picks; wds: WebDataset shards")
    p.add_argument("--shard-size", type=int, help="wds: samples a shard (default 1000)")
    p.add_argument("--max-side", type=int, help="jpeg: downscale so the longer side is at most N px")
    p.add_argument("--quality", type=int, default=90, help="jpeg quality (default 90)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--force", action="store_true", help="replace an existing packed dataset (wds: shard folder) at OUT")


def _bench_commands(sub):
    """bench data, bench infer; returns the bench sub-parsers."""
    p = sub.add_parser("bench", help="measure throughput against baselines (data, infer)")
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
    b = bench.add_parser("infer", help="inference latency / throughput of every deployment path vs timm")
    b.add_argument("checkpoint", help="checkpoint file or run directory")
    b.add_argument("--paths", help="comma-separated subset of the paths (default: all seven: timm_eager_fp32, timm_eager_bf16, eager_fp32, eager_bf16, compiled, onnxruntime_fp32, onnxruntime_int8)")
    b.add_argument("--batch-size", type=int, default=32, help="throughput batch size (32)")
    b.add_argument("--repeats", type=int, default=3, help="interleaved rounds (3)")
    b.add_argument("--latency-calls", type=int, default=20, help="batch-1 calls per path per round (20)")
    b.add_argument("--min-time", type=float, default=1.0, help="seconds of batch calls per path per round (1)")
    b.add_argument("--attention", help="attention backend of the vitflow eager/compiled paths (default: the checkpoint's)")
    b.add_argument("--threads", type=int, help="torch and ONNX Runtime threads (default: torch's default)")
    b.add_argument("--json", action="store_true", help="end with one JSON line {path: {latency_ms_p50, ...}}")
    return bench


def _listing_commands(sub) -> None:
    """lr-schedule, report, presets, models."""
    p = sub.add_parser("lr-schedule", help="plot the learning-rate schedule a config will use")
    _add_config_args(p)
    p.add_argument("-o", "--output", default="lr.png", help="PNG to write (default lr.png)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.schedule=restarts")

    p = sub.add_parser("report", help="write PNG curves and one self-contained HTML page for a run")
    p.add_argument("run_dir", help="a run directory (metrics.jsonl, config.yaml, eval.json)")
    p.add_argument("-o", "--output", help="HTML file (default RUN_DIR/report.html; PNGs beside it in report/)")
    _add_checkpoint_choice(p)

    p = sub.add_parser("presets", help="list presets, or print one resolved")
    p.add_argument("name", nargs="?")

    p = sub.add_parser("models", help="list model variants")
    p.add_argument("pattern", nargs="?", help="shell pattern, e.g. 'vit_small_*'")
