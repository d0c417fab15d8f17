"""``vitflow serve``: a model behind an HTTP service (uvicorn workers, or Ray Serve replicas with
``--ray``); parses nothing, builds the settings, calls :mod:`vitflow.infer.serve`."""

from __future__ import annotations

import argparse

from vitflow.cli.outputs import chosen


def cmd_serve(args: argparse.Namespace) -> int:
    from vitflow.infer.serve import ServeSettings

    settings = ServeSettings(
        source=chosen(args), host=args.host, port=args.port, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue, timeout=args.timeout, workers=args.workers, threads=args.threads,
        decode_threads=args.decode_threads, backend=args.backend, device=args.device, weights=args.weights,
        tta=args.tta, max_body_bytes=args.max_body_bytes, max_pixels=args.max_pixels, max_images=args.max_images,
        topk=args.topk, log_json=args.log_json, name=args.name, api_key_file=args.api_key_file,
        metrics_open=args.metrics_open, auth_failures=args.auth_failures, tls_cert=args.tls_cert, tls_key=args.tls_key)
    if args.ray:
        from vitflow.infer.serve.ray import run_ray

        return run_ray(settings, args.replicas)
    from vitflow.infer.serve.server import run_server

    return run_server(settings)
