"""The stores behind :mod:`vitflow.data.remote.fs`: URL helpers, one fsspec filesystem per scheme and
process, the error classification and the retry loop (:func:`with_retries`), and the settings
(:func:`configure`). See :mod:`vitflow.data.remote.fs` for what is retried and where credentials
come from."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from vitflow.data.sources.base import DataError

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
MAX_BACKOFF = 30.0  # seconds: the longest wait between two attempts
STREAM_BLOCK = 8 << 20  # bytes fetched per request by a sequential stream
RANDOM_BLOCK = 64 << 10  # read-ahead of a random-access file's small reads (tar headers)
TRANSIENT_S3 = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                "InternalError", "ServiceUnavailable", "RequestLimitExceeded"}


class RemoteError(DataError):
    """A remote file that cannot be read: ``url``, the HTTP status (``None`` for a connection
    error or an S3 error without one) and whether it was transient (the retries ran out)."""

    def __init__(self, message: str, url: str = "", status: int | None = None, transient: bool = False):
        super().__init__(message)
        self.url, self.status, self.transient = url, status, transient

    def __reduce__(self):  # keeps url / status across a loader worker's pickling
        return RemoteError, (str(self), self.url, self.status, self.transient)


@dataclass
class Settings:
    """How remote reads behave (see :func:`configure`)."""

    retries: int = 5  # attempts after the first one, on transient errors
    backoff: float = 1.0  # seconds: the first wait; doubled each attempt (with jitter), at most MAX_BACKOFF
    cache_dir: str | None = None  # local cache of whole files read by open_stream
    cache_max_size: int | None = None  # bytes; None: unbounded


SETTINGS = Settings()


def configure(retries: int | None = None, backoff: float | None = None, cache_dir: str | None = None,
              cache_max_size: int | None = None) -> None:
    """Set this process's remote-read settings (``None`` leaves one as it is, except the cache,
    which follows ``cache_dir``)."""
    if retries is not None:
        SETTINGS.retries = int(retries)
    if backoff is not None:
        SETTINGS.backoff = float(backoff)
    SETTINGS.cache_dir, SETTINGS.cache_max_size = cache_dir, cache_max_size


def is_remote(path: object) -> bool:
    """True when ``path`` is a URL with a scheme other than ``file://`` (``s3://b/k``, ``https://...``)."""
    m = SCHEME.match(str(path))
    return m is not None and m.group(1).lower() != "file"


def local_path(path: object) -> str:
    """``path`` without a ``file://`` prefix, ``~`` expanded."""
    p = str(path)
    return os.path.expanduser(p[7:] if p.lower().startswith("file://") else p)


def join(base: object, *parts: str) -> str:
    """``base/part/...`` for a URL or a local path (a URL keeps its ``//``)."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(local_path(base), *parts)


def basename(path: object) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent(path: object) -> str:
    """The folder holding ``path`` (a URL's parent is a URL)."""
    if is_remote(path):
        return str(path).rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(local_path(path)))


# -- the stores -----------------------------------------------------------------------------------

_FS: dict[tuple[int, str], object] = {}


def filesystem(url: str):
    """The fsspec filesystem for ``url``'s scheme, built once per process: S3 with the endpoint of
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (passed explicitly) and s3fs's and botocore's own
    retries off (this module retries); HTTP with a socket timeout.

    Raises:
        RemoteError: no fsspec implementation for the scheme (e.g. gcsfs not installed).
    """
    scheme = SCHEME.match(url).group(1).lower()
    key = (os.getpid(), scheme)
    if key not in _FS:
        import fsspec

        kwargs: dict = {}
        if scheme in ("s3", "s3a"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            kwargs = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                                                      "connect_timeout": 10, "read_timeout": 60}}
            if endpoint:
                kwargs["endpoint_url"] = endpoint
        elif scheme in ("http", "https"):
            import aiohttp

            kwargs = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)}}
        try:
            _FS[key] = fsspec.filesystem(scheme, skip_instance_cache=True, **kwargs)
            if scheme in ("s3", "s3a"):
                _FS[key].retries = 1  # s3fs's own retry loop: once (with_retries retries)
        except (ImportError, ValueError) as e:
            raise RemoteError(f"{url}: cannot read {scheme}:// paths ({e}); install vitflow[remote] "
                              f"(and gcsfs for gs://)", url) from None
    return _FS[key]


def _classify(e: BaseException, url: str) -> tuple[int | None, bool, str]:
    """``(HTTP status or None, transient?, one-line reason)`` for an exception from a store."""
    s3 = url.lower().startswith(("s3://", "s3a://"))
    if isinstance(e, FileNotFoundError) and isinstance(e.__cause__, Exception):
        return _classify(e.__cause__, url)  # fsspec's HTTP stat turns every failure into "not found"
    cause = e.__cause__ if e.__cause__ is not None else e
    resp = getattr(cause, "response", None)
    if isinstance(resp, dict) and "Error" in resp:  # botocore ClientError (s3fs keeps it as the cause)
        code = resp["Error"].get("Code", "")
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        status = status or (int(code) if str(code).isdigit() else None)
        msg = resp["Error"].get("Message") or code
        transient = code in TRANSIENT_S3 or (status or 0) >= 500 or status == 429
        return status, transient, f"S3 error {code} (HTTP {status}): {msg}"
    status = getattr(e, "status", None)
    if isinstance(status, int) and status >= 400:  # aiohttp.ClientResponseError and alike
        return status, status >= 500 or status in (408, 429), f"HTTP {status} {getattr(e, 'message', '') or ''}".strip()
    if isinstance(e, FileNotFoundError):
        return 404, False, "S3 error NoSuchKey (HTTP 404): not found" if s3 else "HTTP 404 Not Found"
    if isinstance(e, PermissionError):
        return 403, False, f"S3 error AccessDenied (HTTP 403): {e}" if s3 else f"HTTP 403 Forbidden ({e})"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return None, True, f"timed out ({type(e).__name__})"
    permanent = _permanent_network_error(e)
    if permanent:
        return None, False, permanent
    name = type(e).__name__
    kinds = " ".join(c.__name__ for c in type(e).__mro__)  # aiohttp's ServerDisconnectedError is a ...ConnectionError
    if isinstance(e, (OSError, ConnectionError)) or "Connect" in kinds or "Payload" in kinds:
        return None, True, f"connection failed ({name}: {str(e) or 'no detail'})"
    return None, False, f"{name}: {e}"


def _permanent_network_error(e: BaseException) -> str | None:
    """The reason when ``e`` (or an error it wraps: ``__cause__``, ``__context__``, aiohttp's
    ``os_error`` / ``certificate_error``, botocore's ``kwargs["error"]``) is a failure that no retry
    mends — a TLS certificate the client does not trust, a host name the resolver says does not
    exist; ``None`` otherwise. A resolver that cannot answer now (``EAI_AGAIN``) is transient."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        err = todo.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({getattr(err, 'verify_message', None) or err})"
        if isinstance(err, socket.gaierror) and err.errno not in (socket.EAI_AGAIN, getattr(socket, "EAI_SYSTEM", 0)):
            return f"unknown host ({err.strerror or err})"
        kwargs = getattr(err, "kwargs", None)
        todo += [err.__cause__, err.__context__, getattr(err, "os_error", None),
                 getattr(err, "certificate_error", None), kwargs.get("error") if isinstance(kwargs, dict) else None]
    return None


def with_retries(url: str, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried on transient errors (see the module docstring); each retry is logged.

    Raises:
        RemoteError: a permanent error at once (403, 404, ...), a transient one when the retries
            have run out; the message names ``url`` and the error.
    """
    attempts = SETTINGS.retries + 1
    for attempt in range(attempts):
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - every store raises its own kinds; _classify sorts them
            status, transient, why = _classify(e, url)
            if not transient:
                raise RemoteError(f"{url}: {what} failed: {why} (not retried)", url, status) from None
            if attempt == attempts - 1:
                raise RemoteError(f"{url}: {what} failed after {attempts} attempts: {why}", url, status,
                                  True) from None
            delay = min(MAX_BACKOFF, SETTINGS.backoff * 2 ** attempt) * random.uniform(0.5, 1.0)
            log.warning("%s: %s failed (%s); retry %d of %d in %.1f s", url, what, why, attempt + 1,
                        SETTINGS.retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def file_size(url: str) -> int:
    """The size in bytes of the remote file ``url``. Raises RemoteError."""
    fs = filesystem(url)
    return int(with_retries(url, "size request", lambda: fs.size(url)))


def exists(url: str) -> bool:
    """True when ``url`` names a readable file (local or remote); ``False`` on 404.

    Raises:
        RemoteError: any other error once the retries have run out.
    """
    if not is_remote(url):
        return os.path.isfile(local_path(url))
    fs = filesystem(url)
    try:
        return bool(with_retries(url, "size request", lambda: fs.info(url)))
    except RemoteError as e:
        if e.status == 404:
            return False
        raise
