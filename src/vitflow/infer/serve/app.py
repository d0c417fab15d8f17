"""The HTTP face of ``vitflow serve``: a FastAPI (Starlette) application, served by uvicorn or by
Ray Serve's replicas.

Routes (answers are JSON; the fields are documented in the deployment guide and kept stable):

- ``POST /v1/classify`` -> ``{"model", "predictions": [{"top": [{"class", "index", "prob"}],
  "labels"?}], "batch_size", "timing_ms"}``: one prediction per image, in order;
- ``POST /v1/embed`` -> ``{"model", "embeddings": [[float, ...]], "dim", "batch_size", "timing_ms"}``;
- ``GET /healthz`` (the process answers), ``GET /readyz`` (model loaded and warmed up: 200, else
  503), ``GET /metrics`` (Prometheus text), ``GET /docs`` and ``/openapi.json``.

Every error answer is ``{"error": "<one line>", "kind": "<kind>", "status": N}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vitflow.infer.serve.inputs import RequestError, parse_upload, read_body, request_timeout, top_k
from vitflow.infer.serve.service import Service
from vitflow.infer.serve.settings import ENV_VAR, ServeSettings

access_log = logging.getLogger("vitflow.serve.access")
IMAGE_BODY = {"requestBody": {"required": True, "content": {
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "file": {"type": "string", "format": "binary"}, "top_k": {"type": "integer"}}}},
    "application/json": {"schema": {"type": "object", "properties": {
        "image": {"type": "string", "description": "base64"},
        "images": {"type": "array", "items": {"type": "string", "description": "base64"}},
        "top_k": {"type": "integer"}}}}}},
    "parameters": [{"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1}},
                   {"name": "timeout", "in": "query", "required": False, "description": "seconds, at most --timeout",
                    "schema": {"type": "number", "exclusiveMinimum": 0}}]}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": e.message, "kind": e.kind, "status": e.status}, e.status, headers=e.headers)


async def answer(request: Request, route: str, settings: ServeSettings) -> Response:
    """One ``/v1/classify`` or ``/v1/embed`` request: read, check, decode, batch, answer."""
    service: Service = request.app.state.service
    t0 = time.monotonic()
    try:
        deadline = t0 + request_timeout(request, settings.timeout)
        service.check_capacity()
        body = await read_body(request, settings.max_body_bytes, deadline)
        upload = await parse_upload(request, body, settings.max_images)
        k = top_k(request, upload.options, settings.topk)
        rows, info, timing = await service.run(route, upload, deadline)
    except RequestError as e:
        request.state.error_kind = e.kind
        return error_response(e)
    out = {"model": service.info}
    if route == "classify":
        out["predictions"] = service.predictor.answers(rows, k)
    else:
        out["embeddings"], out["dim"] = rows.tolist(), int(rows.shape[1])
    out["batch_size"] = info.size
    out["timing_ms"] = {**timing, "total_ms": round((time.monotonic() - t0) * 1e3, 2)}
    return JSONResponse(out)


def _drain_on_signals(service: Service) -> Callable[[], None]:
    """On SIGTERM / SIGINT, besides uvicorn's own handling (stop accepting, wait for the open
    requests), the batchers stop waiting for more images (:meth:`Service.drain`), so a batch
    gathering for up to ``--max-wait-ms`` does not hold the drain that long. Returns the function
    that puts the previous handlers back. Outside the main thread (a Ray Serve replica: Ray handles
    its signals) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(sig, frame) -> None:
        loop.call_soon_threadsafe(service.drain)
        if callable(previous[sig]):
            previous[sig](sig, frame)

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    for sig in previous:
        signal.signal(sig, handler)
    return restore


def create_app(settings: ServeSettings) -> FastAPI:
    """The application for prepared ``settings`` (:func:`vitflow.infer.serve.backends.prepare`);
    the model is loaded and warmed up in its lifespan start-up, before it accepts requests."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = Service(settings)
        await app.state.service.start()
        restore = _drain_on_signals(app.state.service)
        yield
        restore()
        await app.state.service.stop()

    app = FastAPI(title="vitflow serve", version="1", lifespan=lifespan,
                  description=f"Image classification with {settings.name} ({settings.source})")
    app.add_middleware(AccessLog, service=lambda: getattr(app.state, "service", None), log_json=settings.log_json)

    @app.post("/v1/classify", openapi_extra=IMAGE_BODY, summary="top-k classes of one or more images")
    async def classify(request: Request) -> Response:
        return await answer(request, "classify", settings)

    @app.post("/v1/embed", openapi_extra=IMAGE_BODY, summary="pooled features of one or more images")
    async def embed(request: Request) -> Response:
        return await answer(request, "embed", settings)

    @app.get("/healthz", summary="the process answers")
    async def healthz() -> dict:
        return {"ok": True, "pid": os.getpid()}

    @app.get("/readyz", summary="the model is loaded and warmed up")
    async def readyz(request: Request) -> Response:
        service = getattr(request.app.state, "service", None)
        if service is None or not service.ready:
            return JSONResponse({"ready": False}, 503)
        return JSONResponse({"ready": True, "model": service.info, "pid": os.getpid()})

    @app.get("/metrics", summary="Prometheus metrics (text format)")
    async def metrics(request: Request) -> Response:
        body, ctype = request.app.state.service.metrics.render()
        return Response(body, media_type=ctype)

    return app


class AccessLog:
    """ASGI middleware: one log line per request at info level (``METHOD PATH STATUS MS``, or a
    JSON object with ``--log-json``) and the request counters and latency histogram."""

    ROUTES = {"/v1/classify": "classify", "/v1/embed": "embed", "/healthz": "healthz", "/readyz": "readyz",
              "/metrics": "metrics"}

    def __init__(self, app, service, log_json: bool = False):
        self.app, self.service, self.log_json = app, service, log_json

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._record(scope, status[0], time.perf_counter() - t0)

    def _record(self, scope, status: int, seconds: float) -> None:
        route = self.ROUTES.get(scope["path"], "other")
        state = scope.get("state", {})
        service = self.service()
        if service is not None:
            service.metrics.requests.labels(route, str(status)).inc()
            service.metrics.request_seconds.labels(route).observe(seconds)
            if status >= 400:
                service.metrics.errors.labels(state.get("error_kind", f"http_{status}")).inc()
        if route in ("metrics", "healthz", "readyz") and status == 200:
            return
        client = scope.get("client") or ("-", 0)
        fields = {"method": scope["method"], "path": scope["path"], "status": status, "ms": round(seconds * 1e3, 2),
                  "client": client[0], **({"kind": state["error_kind"]} if "error_kind" in state else {})}
        if access_log.isEnabledFor(logging.INFO):
            access_log.info(json.dumps(fields) if self.log_json else
                            "{method} {path} {status} {ms} ms {client}".format(**fields) + f" {fields.get('kind', '')}")


def configure_logging(log_json: bool) -> None:
    """vitflow's log lines on stderr in the worker: plain (``LEVEL logger: message``) or, with
    ``--log-json``, the access lines as bare JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if log_json else "%(levelname)s %(name)s: %(message)s"))
    for name in ("vitflow.serve", "vitflow.serve.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def app_from_env() -> FastAPI:
    """uvicorn's application factory in each worker process: the settings come as JSON in
    ``VITFLOW_SERVE_SETTINGS``."""
    settings = ServeSettings.from_json(os.environ[ENV_VAR])
    configure_logging(settings.log_json)
    return create_app(settings)
