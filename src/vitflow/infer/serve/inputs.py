"""A request's images, read and checked before any decoding: the body (bounded in bytes and in
time), then raw bytes, a multipart upload or JSON with base64 images.

Every problem is a :class:`RequestError`: an HTTP status, a short ``kind`` (the ``errors_total``
label and the ``kind`` field of the answer) and one line naming the problem.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from dataclasses import dataclass, field

from starlette.requests import Request

RAW_TYPES = ("image/", "application/octet-stream")
MIN_TIMEOUT_S = 0.5  # the shortest ?timeout= a request may ask for (seconds)


class RequestError(Exception):
    """An answer other than 200: ``status``, ``kind`` and a one-line ``message``; ``headers``
    to add (``Retry-After``)."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


@dataclass
class Upload:
    """The images of a request (``(name, encoded bytes)``, in order) and its options."""

    images: list[tuple[str, bytes]]
    options: dict = field(default_factory=dict)


async def read_body(request: Request, limit: int, deadline: float) -> bytes:
    """The whole body, at most ``limit`` bytes, received before ``deadline`` (``time.monotonic()``).

    Raises:
        RequestError: 413 ``body_too_large`` (by ``Content-Length`` before reading, or once the
            bytes received pass ``limit``), 408 ``body_timeout`` (a slow upload), 400 ``empty_body``.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, "body_too_large", f"request body of {int(declared)} bytes is over the limit of "
                           f"{limit} bytes (--max-body-bytes)")
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise RequestError(408, "body_timeout", f"request body not received within the deadline ({size} bytes "
                               "so far; --timeout)") from None
        size += len(chunk)
        if size > limit:
            raise RequestError(413, "body_too_large", f"request body over the limit of {limit} bytes "
                               "(--max-body-bytes)")
        chunks.append(chunk)
    if size == 0:
        raise RequestError(400, "empty_body", "empty request body: send an image (raw bytes, multipart or JSON)")
    return b"".join(chunks)


async def parse_upload(request: Request, body: bytes, max_images: int) -> Upload:
    """The images of ``body`` by the request's ``Content-Type``:

    - ``image/*`` or ``application/octet-stream`` (or none): the body is one image;
    - ``multipart/form-data``: every file part, in order (other fields are options: ``top_k``);
    - ``application/json``: ``{"image": "<base64>"}`` or ``{"images": ["<base64>", ...]}``
      (``data:`` URLs too), with options beside them (``"top_k": 3``).

    Raises:
        RequestError: 415 ``unsupported_media_type``, 400 ``bad_json`` / ``bad_base64`` /
            ``missing_field`` / ``bad_multipart``, 413 ``too_many_images``.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not ctype or ctype.startswith(RAW_TYPES):
        upload = Upload([("body", body)])
    elif ctype == "multipart/form-data":
        upload = await _multipart(request, body, max_images)
    elif ctype == "application/json" or ctype.endswith("+json"):
        upload = _json(body)
    else:
        raise RequestError(415, "unsupported_media_type", f"Content-Type {ctype} is not accepted: send image/* or "
                           "application/octet-stream bytes, multipart/form-data or application/json")
    if not upload.images:
        raise RequestError(400, "missing_field", "no image in the request (multipart: a file part; JSON: "
                           "\"image\" or \"images\")")
    empty = next((name for name, data in upload.images if not data), None)
    if empty is not None:  # a malformed request is 400 before a well-formed one is too large
        raise RequestError(400, "empty_body", f"{empty} is empty (0 bytes)")
    if len(upload.images) > max_images:
        raise RequestError(413, "too_many_images", f"{len(upload.images)} images in one request; the limit is "
                           f"{max_images} (--max-images)")
    return upload


async def _multipart(request: Request, body: bytes, max_images: int) -> Upload:
    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=max_images + 1, max_fields=16)
    except Exception as e:  # starlette's MultiPartException and python-multipart's errors
        raise RequestError(400, "bad_multipart", f"malformed multipart body: {e}") from None
    images, options = [], {}
    for key, value in form.multi_items():
        if isinstance(value, str):
            options[key] = value
        else:
            images.append((value.filename or key, await value.read()))
    await form.close()
    return Upload(images, options)


def _json(body: bytes) -> Upload:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, "bad_json", f"malformed JSON body: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError(400, "bad_json", f"the JSON body must be an object, not {type(doc).__name__}")
    if "image" in doc:
        encoded, names = [doc.pop("image")], ["image"]
    elif "images" in doc:
        encoded = doc.pop("images")
        if not isinstance(encoded, list):
            raise RequestError(400, "bad_json", "\"images\" must be a list of base64 strings")
        names = [f"images[{i}]" for i in range(len(encoded))]
    else:
        raise RequestError(400, "missing_field", "the JSON body has no \"image\" (base64) or \"images\" (a list "
                           f"of them); it has {sorted(doc) or 'no keys'}")
    return Upload([(n, _b64(n, e)) for n, e in zip(names, encoded)], doc)


def _b64(name: str, value) -> bytes:
    if not isinstance(value, str):
        raise RequestError(400, "bad_json", f"{name} must be a base64 string, not {type(value).__name__}")
    if value.startswith("data:") and "," in value:
        value = value.split(",", 1)[1]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(400, "bad_base64", f"{name} is not valid base64: {e}") from None


def top_k(request: Request, options: dict, default: int) -> int:
    """``top_k`` from the query string, else the body's options (default ``default``); each one
    given is checked, the query's winning.

    Raises:
        RequestError: 400 ``bad_parameter`` for a value that is not an integer >= 1.
    """
    given = [v for v in (request.query_params.get("top_k"), options.get("top_k")) if v is not None]
    for value in given:
        try:
            k = int(value)
            if isinstance(value, float) or k < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise RequestError(400, "bad_parameter", f"top_k={value!r}: must be an integer >= 1") from None
    return int(given[0]) if given else default


def request_timeout(request: Request, limit: float) -> float:
    """The request's deadline in seconds from its arrival: ``?timeout=SECONDS`` when given (at
    most ``limit``, ``--timeout``), else ``limit``.

    Raises:
        RequestError: 400 ``bad_parameter`` for a value that is not a number >= :data:`MIN_TIMEOUT_S`
            (a shorter deadline would be spent before the body is read).
    """
    value = request.query_params.get("timeout")
    if value is None:
        return limit
    try:
        seconds = float(value)
        if not seconds >= MIN_TIMEOUT_S:
            raise ValueError
    except ValueError:
        raise RequestError(400, "bad_parameter", f"timeout={value!r}: must be a number of seconds >= "
                           f"{MIN_TIMEOUT_S:g}") from None
    return min(seconds, limit)
