"""The HTTP face of ``vitflow serve``: a FastAPI (Starlette) application, served by uvicorn or by
Ray Serve's replicas.

Routes (answers are JSON; the fields are documented in the deployment guide and kept stable):

- ``POST /v1/classify`` -> ``{"model", "predictions": [{"top": [{"class", "index", "prob"}],
  "labels"?}], "batch_size", "timing_ms"}``: one prediction per image, in order;
- ``POST /v1/embed`` -> ``{"model", "embeddings": [[float, ...]], "dim", "batch_size", "timing_ms"}``;
- ``POST /v1/attention`` (one image) -> ``{"model", "class", "index", "prob", "maps", "grid": [h, w],
  "rollout": [[float]] (h x w, maximum 1), "view": [x0, y0, x1, y1], "timing_ms"}``: where the model
  looks (attention rollout, :mod:`vitflow.infer.features.attention`) over the box ``view`` of the
  uploaded image (its pixels: what the eval crop keeps); 501 without a PyTorch model;
- ``GET /v1/model`` -> the model's card: name, version, backend, task, classes and their names,
  input size, crop, whether ``/v1/attention`` answers;
- ``GET /`` (a page to try the model in a browser: :mod:`.page`), ``GET /healthz`` (the process
  answers), ``GET /readyz`` (model loaded and warmed up: 200, else 503), ``GET /metrics``
  (Prometheus text), ``GET /docs`` and ``/openapi.json``.

With API keys (:mod:`.auth`) every route but the page, the health checks and the schema needs
one. Every error answer is ``{"error": "<one line>", "kind": "<kind>", "status": N}``; the schema
lists each status a route can answer.
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
from importlib import resources
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from vitflow.infer.serve.auth import OPEN_PATHS, ApiKeys, RequireKey, keys_from_env
from vitflow.infer.serve.inputs import (
    MIN_TIMEOUT_S,
    RequestError,
    Upload,
    parse_upload,
    read_body,
    request_timeout,
    top_k,
)
from vitflow.infer.serve.service import Service
from vitflow.infer.serve.settings import ENV_VAR, ServeSettings

access_log = logging.getLogger("vitflow.serve.access")
# the page at /: one self-contained file (no CDN: it works offline), calling the API below with the key typed in it
PAGE = resources.files("vitflow.infer.serve").joinpath("page.html").read_text(encoding="utf-8")
IMAGE_BODY = {"requestBody": {"required": True, "content": {
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
        "file": {"type": "string", "format": "binary"}, "top_k": {"type": "integer", "minimum": 1}}}},
    "application/json": {"schema": {"type": "object", "anyOf": [{"required": ["image"]}, {"required": ["images"]}],
                                    "properties": {
        "image": {"type": "string", "minLength": 1, "description": "base64"},
        "images": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1, "description": "base64"}},
        "top_k": {"type": "integer", "minimum": 1}}}}}},
    "parameters": [{"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1}},
                   {"name": "timeout", "in": "query", "required": False, "description": "seconds, at most --timeout",
                    "schema": {"type": "number", "minimum": MIN_TIMEOUT_S}}]}
ERROR = {"content": {"application/json": {"schema": {"type": "object", "required": ["error", "kind", "status"],
                                                     "properties": {"error": {"type": "string"},
                                                                    "kind": {"type": "string"},
                                                                    "status": {"type": "integer"}}}}}}
STATUSES = {400: "a bad request or image (one line naming it)", 401: "no API key, or not an accepted one",
            408: "the body did not arrive within the deadline", 413: "too large: body, image or image count",
            415: "not an image type the service reads", 429: "too many failed API key attempts from this address",
            501: "not available for this model", 503: "overloaded (Retry-After), or not ready",
            504: "the deadline passed before the answer"}


def _answers(*statuses: int) -> dict:
    """OpenAPI ``responses`` for the error ``statuses`` a route can answer (each the error object)."""
    return {"responses": {str(c): {"description": STATUSES[c], **ERROR} for c in statuses}}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": e.message, "kind": e.kind, "status": e.status}, e.status, headers=e.headers)


async def read_images(request: Request, settings: ServeSettings, service: Service, t0: float
                      ) -> tuple[float, Upload, int]:
    """The reading every image route shares: the deadline, room for one more image, the body,
    its images and ``top_k`` (checked on every route, used by ``/v1/classify``).

    Returns: ``(deadline, upload, k)``. Raises: RequestError (the statuses of :data:`STATUSES`)."""
    deadline = t0 + request_timeout(request, settings.timeout)
    service.check_capacity()
    body = await read_body(request, settings.max_body_bytes, deadline)
    upload = await parse_upload(request, body, settings.max_images)
    return deadline, upload, top_k(request, upload.options, settings.topk)


async def answer(request: Request, route: str, settings: ServeSettings) -> Response:
    """One ``/v1/classify`` or ``/v1/embed`` request: read, check, decode, batch, answer."""
    service: Service = request.app.state.service
    t0 = time.monotonic()
    try:
        deadline, upload, k = await read_images(request, settings, service, t0)
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


async def answer_attention(request: Request, settings: ServeSettings) -> Response:
    """One ``/v1/attention`` request: read, check, decode, run the maps on the model thread, answer."""
    service: Service = request.app.state.service
    t0 = time.monotonic()
    try:
        deadline, upload, _ = await read_images(request, settings, service, t0)
        if len(upload.images) != 1:
            raise RequestError(400, "one_image", f"/v1/attention takes one image; the request holds "
                               f"{len(upload.images)}")
        maps, timing = await service.attention(*upload.images[0], deadline)
    except RequestError as e:
        request.state.error_kind = e.kind
        return error_response(e)
    prob, index = maps["probs"].max(0)
    return JSONResponse({"model": service.info, "class": service.predictor.classes[int(index)], "index": int(index),
                         "prob": round(float(prob), 6), "maps": maps["maps"], "grid": list(maps["grid"]),
                         "rollout": maps["rollout"].round(decimals=4).tolist(),
                         "view": [round(v, 2) for v in maps["view"]],
                         "timing_ms": {**timing, "total_ms": round((time.monotonic() - t0) * 1e3, 2)}})


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


def _reload_on_sighup(keys: ApiKeys | None) -> Callable[[], None]:
    """``SIGHUP`` reads the API key file again (the supervisor passes its SIGHUP on to the workers);
    returns the function that puts the previous handler back. Outside the main thread, or without
    keys, nothing is installed (a worker without keys ignores SIGHUP rather than dying of it)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if keys is None else
                  (lambda sig, frame: loop.call_soon_threadsafe(keys.reload)))
    return lambda: signal.signal(signal.SIGHUP, previous)


def create_app(settings: ServeSettings) -> FastAPI:
    """The application for prepared ``settings`` (:func:`vitflow.infer.serve.backends.prepare`);
    the model is loaded and warmed up in its lifespan start-up, before it accepts requests.
    Raises KeyFileError: API keys configured and unreadable."""
    env_keys = keys_from_env()
    keys = ApiKeys(settings.api_key_file, env_keys) if settings.api_key_file or env_keys else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = Service(settings)
        await app.state.service.start()
        restore = _drain_on_signals(app.state.service)
        unhup = _reload_on_sighup(keys)
        yield
        unhup()
        restore()
        await app.state.service.stop()

    app = FastAPI(title="vitflow serve", version="1", lifespan=lifespan,
                  description=f"Image classification with {settings.name} ({settings.source})")
    guarded: tuple[int, ...] = ()
    service = lambda: getattr(app.state, "service", None)  # noqa: E731  (set by the lifespan)
    if keys is not None:
        open_paths = OPEN_PATHS | ({"/metrics"} if settings.metrics_open else set())
        app.add_middleware(RequireKey, keys=keys, open_paths=open_paths,
                           count=lambda reason: service() and service().metrics.auth_failures.labels(reason).inc(),
                           failures=settings.auth_failures)
        guarded = (401, 429) if settings.auth_failures else (401,)
        _document_keys(app)
    # outermost: the access log and the request counters see the refused requests too
    app.add_middleware(AccessLog, service=service, log_json=settings.log_json)
    image_route = {**IMAGE_BODY, **_answers(400, *guarded, 408, 413, 415, 503, 504)}

    @app.post("/v1/classify", openapi_extra=image_route, summary="top-k classes of one or more images")
    async def classify(request: Request) -> Response:
        return await answer(request, "classify", settings)

    @app.post("/v1/embed", openapi_extra=image_route, summary="pooled features of one or more images")
    async def embed(request: Request) -> Response:
        return await answer(request, "embed", settings)

    @app.post("/v1/attention", openapi_extra={**IMAGE_BODY, **_answers(400, *guarded, 408, 413, 415, 501, 503, 504)},
              summary="where the model looks in one image: attention rollout over the part of it the model sees")
    async def attention(request: Request) -> Response:
        return await answer_attention(request, settings)

    _describing_routes(app, settings, guarded)
    return app


def _describing_routes(app: FastAPI, settings: ServeSettings, guarded: tuple[int, ...]) -> None:
    """The routes that describe the service: the model's card, the page, the health checks and the
    metrics (``guarded``: the key statuses of the routes that need one)."""

    @app.get("/v1/model", openapi_extra=_answers(*guarded, 503), summary="the model's card")
    async def model_card(request: Request) -> Response:
        service = getattr(request.app.state, "service", None)
        if service is None or not service.ready:
            return error_response(RequestError(503, "not_ready", "the model is loading"))
        return JSONResponse({**service.info, "class_names": service.predictor.classes,
                             "crop_pct": service.predictor.pp.crop_pct, "attention": service.has_torch_model})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/healthz", summary="the process answers")
    async def healthz() -> dict:
        return {"ok": True, "pid": os.getpid()}

    @app.get("/readyz", summary="the model is loaded and warmed up",
             responses={503: {"description": "not ready yet", "content": {"application/json": {}}}})
    async def readyz(request: Request) -> Response:
        service = getattr(request.app.state, "service", None)
        if service is None or not service.ready:
            return JSONResponse({"ready": False}, 503)
        return JSONResponse({"ready": True, "model": service.info, "pid": os.getpid()})

    metrics_guard = () if settings.metrics_open else guarded

    @app.get("/metrics", summary="Prometheus metrics (text format)", response_class=PlainTextResponse,
             openapi_extra=_answers(*metrics_guard))
    async def metrics(request: Request) -> Response:
        body, ctype = request.app.state.service.metrics.render()
        return Response(body, media_type=ctype)


def _document_keys(app: FastAPI) -> None:
    """The schema names the two ways to present a key (``components.securitySchemes``) and
    requires one on every route that does."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
            for path, ops in schema["paths"].items():
                for op in ops.values():
                    if "401" in op.get("responses", {}):
                        op["security"] = [{"bearer": []}, {"apiKey": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class AccessLog:
    """ASGI middleware: one log line per request at info level (``METHOD PATH STATUS MS``, or a
    JSON object with ``--log-json``) and the request counters and latency histogram."""

    ROUTES = {"/v1/classify": "classify", "/v1/embed": "embed", "/v1/attention": "attention", "/v1/model": "model",
              "/": "page", "/healthz": "healthz", "/readyz": "readyz", "/metrics": "metrics"}

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
