"""``vitflow serve``: a model behind an HTTP service (uvicorn workers, or Ray Serve replicas with
``--ray``); parses nothing, builds the settings, calls :mod:`vitflow.infer.serve`."""

from __future__ import annotations

import argparse

from vitflow.cli.outputs import chosen


def add_serve_command(sub) -> None:
    """The ``serve`` sub-command and its options."""
    from vitflow.cli.parser import _add_checkpoint_choice, _add_tta_arg, _add_weights_arg, _positive

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


def cmd_serve(args: argparse.Namespace) -> int:
    from vitflow.infer.serve import ServeSettings

    settings = ServeSettings(
        source=chosen(args), host=args.host, port=args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue, timeout=args.timeout, workers=args.workers, threads=args.threads,
        decode_threads=args.decode_threads, backend=args.backend, device=args.device, weights=args.weights,
        tta=args.tta, max_body_bytes=args.max_body_bytes, max_pixels=args.max_pixels, max_images=args.max_images,
        topk=args.topk, log_json=args.log_json, name=args.name)
    if args.ray:
        from vitflow.infer.serve.ray import run_ray

        return run_ray(settings, args.replicas)
    from vitflow.infer.serve.server import run_server

    return run_server(settings)
