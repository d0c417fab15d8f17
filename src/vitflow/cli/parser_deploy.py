"""The ``vitflow`` commands that deploy a trained model: ``export``, ``prune``, ``quantize``, ``embed``
and ``serve`` (their arguments and help)."""

from __future__ import annotations

import argparse

from vitflow.cli.arguments import checkpoint_choice, merge_count, positive, tta_arg, weights_arg


def deployment_commands(sub) -> None:
    """export, quantize, prune."""
    embed_command(sub)
    p = sub.add_parser("export", help="export a checkpoint (ONNX, TorchScript, ExportedProgram, TensorRT, hub-style "
                       "folder), verified")
    p.add_argument("checkpoint", help="checkpoint file or run directory (--format openvino: also a vitflow .onnx)")
    checkpoint_choice(p)
    p.add_argument("--format", default="onnx",
                   choices=["onnx", "torchscript", "exported-program", "tensorrt", "openvino", "hub", "triton"],
                   help="openvino: an OpenVINO IR (.xml + .bin) with vitflow's metadata; hub: a new folder of "
                   "config.json, model.safetensors (timm names) and README.md (model card) that timm and vitflow "
                   "load; triton: a new Triton model repository (config.pbtxt with dynamic batching, labels.txt, "
                   "1/model.onnx)")
    p.add_argument("--max-batch", type=positive, default=16, help="triton: max_batch_size (16)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="triton: dynamic batching's max queue delay in ms (5)")
    p.add_argument("-o", "--output", required=True, help="output file (.onnx, .ts, .pt2, .engine, .xml) or, for hub "
                   "and triton, a new (or empty) folder")
    p.add_argument("--batch", type=positive, metavar="N", help="openvino: a fixed batch size (static shape; the IR "
                   "then takes batches of N only)")
    p.add_argument("--optimize", action="store_true", help="ONNX: apply ONNX Runtime's transformer fusions")
    p.add_argument("--target", choices=["cpu", "gpu"], help="--optimize for this target (default: gpu if CUDA "
                   "is available, else cpu)")
    p.add_argument("--opset", type=int, default=18, help="ONNX opset (18 or newer; default 18); one the exporter cannot write is refused")
    p.add_argument("--verify-data", metavar="PATH", help="real images (file, folder or tar) to verify on; "
                   "default: the checkpoint's test split")
    p.add_argument("--tolerance", type=float, help="max |logit difference| (default 1e-4; 0.1 for FP16 TensorRT)")
    tta_arg(p, "ONNX: average the probabilities of these views inside the graph (its output becomes their "
                 "log; use flip and/or crops5)")
    p.add_argument("--fp32", action="store_true", help="TensorRT: build an FP32 engine (default FP16)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")

    _add_quantize_command(sub)

    p = sub.add_parser("prune", help="remove blocks / attention heads / MLP units, optionally fine-tune with distillation")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("-o", "--output", required=True, help="pruned checkpoint (.pt)")
    p.add_argument("--heads", type=float, help="fraction of attention heads to remove (0.25 alone, else 0)")
    p.add_argument("--mlp", type=float, default=0.0, help="fraction of all MLP hidden units to remove (0)")
    p.add_argument("--blocks", type=int, default=0, help="whole blocks to remove, least loss rise when skipped first (0)")
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

    p = sub.add_parser("merge-tokens", help="token merging (ToMe): the checkpoint with r tokens merged per block, r "
                       "chosen within --max-drop on its own data")
    p.add_argument("checkpoint", help="checkpoint file or run directory")
    p.add_argument("-o", "--output", required=True, help="merged checkpoint (.pt)")
    p.add_argument("-r", default="auto", type=merge_count, metavar="R|auto",
                   help="tokens merged per block (default auto: the largest within --max-drop)")
    p.add_argument("--max-drop", type=float, default=1.0, help="max top-1 (mAP) drop in points (default 1.0)")
    p.add_argument("--data", metavar="PATH", help="labelled data to measure on (default: the checkpoint's)")
    p.add_argument("--split", help="split to measure on (default: the test split, else validation)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")


def _add_quantize_command(sub) -> None:
    p = sub.add_parser("quantize", help="INT8 (ONNX Runtime, OpenVINO or PyTorch; static with --calibrate) or FP16/BF16 "
                       "weights, with an accuracy guard")
    p.add_argument("model", help="checkpoint, run directory, or a vitflow .onnx model (onnxruntime / openvino backend)")
    p.add_argument("-o", "--output", required=True, help="output: .onnx (onnxruntime), .xml (openvino IR, .bin beside "
                   "it) or .pt (torch)")
    p.add_argument("--backend", choices=["onnxruntime", "torch", "openvino"], default="onnxruntime",
                   help="openvino: INT8 IR by NNCF post-training quantization (always calibrated)")
    _add_calibration_args(p)
    p.add_argument("--dtype", choices=["int8", "fp16", "bf16"], default="int8",
                   help="int8 (default); fp16/bf16 weight casting for GPU inference (torch backend)")
    p.add_argument("--data", metavar="PATH",
                   help="data to measure top-1 (multi-label models: mAP) on before and after: a folder, tar, "
                   "label file or dataset, or a split folder of class folders (PHOTOS/test)")
    p.add_argument("--split", help="split of --data (default: its test split, else its validation split, else all "
                   "of a split folder; e.g. 'test[:2000]')")
    p.add_argument("--max-drop", type=float, default=1.0, help="max top-1 (mAP) drop in points (default 1.0)")
    p.add_argument("--force", action="store_true", help="write the model even if top-1 dropped more")
    p.add_argument("--per-tensor", action="store_true", help="ONNX: one weight scale per tensor (default per channel)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")


def _add_calibration_args(p: argparse.ArgumentParser) -> None:
    """``vitflow quantize``: static INT8 calibrated on real images."""
    g = p.add_argument_group("static INT8 (calibrated activation ranges)")
    g.add_argument("--calibrate", nargs="?", const="", metavar="DATA", help="static INT8: calibrate on DATA (a "
                   "folder, tar or dataset: its train split; a folder of images; a .npy of model inputs), default "
                   "the checkpoint's training data")
    g.add_argument("--calibration-images", type=positive, default=300, metavar="N", help="images to calibrate on (300)")
    g.add_argument("--method", action="append", choices=["minmax", "percentile", "entropy"], help="onnxruntime "
                   "calibration method to try (repeatable; default all three, the guard keeps the best)")
    g.add_argument("--batch", type=positive, metavar="N", help="openvino: fix the IR's batch size (static shape)")


def serve_command(sub) -> None:
    """serve (vitflow.cli.serve runs it)."""
    p = sub.add_parser("serve", help="serve a model over HTTP with dynamic batching (uvicorn workers or Ray Serve)")
    p.add_argument("checkpoint", metavar="SOURCE", help="run directory (newest checkpoint), checkpoint, hub-style "
                   "folder, or an exported .onnx / INT8 .onnx model or OpenVINO .xml IR")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=positive, default=16, help="images in one model call, at most (16)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long the first image of a batch waits for "
                   "more, in ms (5)")
    p.add_argument("--max-queue", type=positive, default=64, help="images held (decoding, queued, running) before "
                   "new requests get 503 with Retry-After (64)")
    p.add_argument("--timeout", type=float, default=30.0, help="a request's deadline in seconds: 408 while its body "
                   "is still arriving, else 504 (30)")
    p.add_argument("--workers", type=positive, default=1, help="server processes, each with its own model and "
                   "batcher; one that dies is restarted (1)")
    p.add_argument("--threads", type=int, default=0, help="PyTorch / ONNX Runtime threads per worker (default: "
                   "the cores divided by the workers)")
    p.add_argument("--decode-threads", type=positive, default=2, help="decoding threads per worker (2)")
    p.add_argument("--backend", default="auto", choices=["auto", "eager_fp32", "eager_bf16", "onnxruntime", "openvino"],
                   help="auto (default): the fastest fp32 path measured at start-up (eager_fp32 or onnxruntime; "
                   "eager_bf16 too on CPUs with native bf16); an .onnx source runs on onnxruntime, an OpenVINO .xml "
                   "on openvino")
    p.add_argument("--device", default="auto")
    weights_arg(p)
    tta_arg(p)
    checkpoint_choice(p)
    p.add_argument("--max-body-bytes", type=positive, default=20 * 2**20, help="request body limit (20 MiB)")
    p.add_argument("--max-pixels", type=positive, default=40_000_000, help="pixels of one image (40 M)")
    p.add_argument("--max-images", type=positive, default=32, help="images in one request (32)")
    p.add_argument("--topk", type=positive, default=5, help="classes per image unless the request asks ?top_k= (5)")
    p.add_argument("--name", help="the model's name in answers (default: the source's file or folder name)")
    p.add_argument("--log-json", action="store_true", help="request log lines as JSON objects")
    g = p.add_argument_group("access")
    g.add_argument("--api-key-file", metavar="FILE", help="API keys, one per line (also VITFLOW_SERVE_API_KEYS, "
                   "comma-separated): requests need Authorization: Bearer KEY or X-API-Key: KEY; reloaded on SIGHUP")
    g.add_argument("--metrics-open", action="store_true", help="/metrics answers without a key (/healthz, /readyz "
                   "and the page always do)")
    g.add_argument("--auth-failures", type=int, default=10, metavar="N", help="failed key attempts from one "
                   "address in a minute before it gets 429 (10; 0: no limit, e.g. behind a proxy all clients share)")
    g.add_argument("--tls-cert", metavar="CERT.pem", help="serve HTTPS with this certificate (chain), PEM")
    g.add_argument("--tls-key", metavar="KEY.pem", help="the certificate's private key, PEM")
    p.add_argument("--ray", action="store_true", help="deploy on Ray Serve (RAY_ADDRESS, or a local Ray instance)")
    p.add_argument("--replicas", type=positive, default=1, help="--ray: replicas, each with its own batcher (1)")


def embed_command(sub) -> None:
    p = sub.add_parser("embed", help="pooled features of images, folders or tars, written as .npy with their paths")
    p.add_argument("model", help="run directory, checkpoint, hub-style model folder, or weights with --model NAME")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR", help="image files, folders or .tar archives")
    p.add_argument("-o", "--output", required=True, metavar="FEATURES.npy",
                   help="float32 (N, D) features; the N image paths go beside it, one per line: FEATURES.paths.txt")
    p.add_argument("--model", dest="model_name", metavar="NAME", help="the architecture of plain weights "
                   "(create_model(NAME, pretrained=MODEL, num_classes=0))")
    p.add_argument("--batch-size", type=positive, default=32)
    p.add_argument("--workers", type=int, default=2, help="image decoding threads (default 2)")
    p.add_argument("--device", default="auto")
    weights_arg(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line: count, dim, output paths")
