"""Whole-file HTTP(S) downloads through the standard library's :mod:`http.client`, for the shards a
training stream spools (:func:`vitflow.data.remote_cache.download`).

Everything else remote (size requests, range reads, listings, S3, ``hf://``) goes through fsspec;
a whole-file GET is the one request whose cost grows with the data, and fsspec's HTTP filesystem
(aiohttp, on an event loop in another thread) spends about twice the CPU per byte of a blocking
socket read into one reused buffer: measured on the project's 2-core machine, downloading the
ImageNet sample's ten 11 MB shards from a server on 127.0.0.1 took 0.124 s of client CPU through
``fsspec.get_file`` and 0.064-0.074 s here (``/proc`` CPU times, warm runs) — CPU the loader's
decoding workers share on such a machine.

Redirects (301, 302, 303, 307, 308) are followed up to :data:`MAX_REDIRECTS` times; user
information in the URL (``https://user:password@host/...``) is sent as HTTP basic authentication;
HTTPS verifies the server's certificate against the system's trust store (as aiohttp does). No
proxy is used (nor is one by vitflow's fsspec HTTP filesystem).
"""

from __future__ import annotations

import base64
import http.client
import ssl
import urllib.parse
from pathlib import Path

BLOCK = 1 << 20  # bytes read from the socket at a time, into one reused buffer
MAX_REDIRECTS = 5
TIMEOUT = 60.0  # seconds: connecting, and each read (the fsspec HTTP filesystem's sock_read)
REDIRECTS = (301, 302, 303, 307, 308)


class HTTPStatusError(Exception):
    """An answer with an error status: ``status`` (int) and ``message`` (the reason phrase), the
    attributes :func:`vitflow.data.remote_store.with_retries` classifies (5xx, 408 and 429 are
    transient)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status} {message}".strip())
        self.status, self.message = status, message


def is_http(url: str) -> bool:
    """True for an ``http://`` or ``https://`` URL."""
    return urllib.parse.urlsplit(str(url)).scheme.lower() in ("http", "https")


def _connect(parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
    if parts.scheme.lower() == "https":
        return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=TIMEOUT,
                                           context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)


def _headers(parts: urllib.parse.SplitResult) -> dict[str, str]:
    headers = {"Accept-Encoding": "identity"}
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(user.encode()).decode("ascii")
    return headers


def _write_body(resp: http.client.HTTPResponse, path: str | Path) -> int:
    """The body of ``resp`` into the file ``path``; returns its bytes. A body shorter than its
    ``Content-Length`` raises ConnectionError."""
    buf = memoryview(bytearray(BLOCK))
    got = 0
    with open(path, "wb") as f:
        while n := resp.readinto(buf):
            f.write(buf[:n])
            got += n
    if resp.length:  # http.client counts down what the Content-Length announced and is still due
        raise ConnectionError(f"short read: the connection closed {resp.length} bytes before the announced end")
    return got


def get_file(url: str, path: str | Path) -> int:
    """Write the body of ``GET url`` into the local file ``path`` (created or overwritten); returns
    the bytes written. One attempt: retries are the caller's (``with_retries``).

    Raises:
        HTTPStatusError: an error status (>= 400), a redirect without ``Location`` or more than
            :data:`MAX_REDIRECTS` of them.
        ConnectionError: the connection closed before the end of the body, or the answer was no
            HTTP (``http.client.HTTPException``, re-raised as a connection error: transient).
        OSError, TimeoutError: refused, reset or timed-out connections.
    """
    for hop in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn = _connect(parts)
        try:
            conn.request("GET", target, headers=_headers(parts))
            resp = conn.getresponse()
            if resp.status in REDIRECTS:
                location = resp.getheader("Location")
                if not location or hop == MAX_REDIRECTS:
                    raise HTTPStatusError(resp.status, f"{resp.reason}: " + (
                        f"more than {MAX_REDIRECTS} redirects" if location else "a redirect without a Location"))
                url = urllib.parse.urljoin(url, location)
                continue
            if resp.status >= 400 or resp.status < 200:
                raise HTTPStatusError(resp.status, resp.reason)
            return _write_body(resp, path)
        except http.client.HTTPException as e:  # IncompleteRead, BadStatusLine, ...: the transfer broke
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()
    raise AssertionError("unreachable")
