"""Whole-file HTTP(S) downloads through the standard library's :mod:`http.client`, for the shards a
training stream spools (:func:`vitflow.data.remote.cache.download`).

Everything else remote (size requests, range reads, listings, S3, ``hf://``) goes through fsspec;
a whole-file GET is the one request whose cost grows with the data, and fsspec's HTTP filesystem
(aiohttp, on an event loop in another thread) spends about twice the CPU per byte of a blocking
socket read into one reused buffer: measured on the project's 2-core machine, downloading the
ImageNet sample's ten 11 MB shards from a server on 127.0.0.1 took 0.124 s of client CPU through
``fsspec.get_file`` and 0.064-0.074 s here (``/proc`` CPU times, warm runs) — CPU the loader's
decoding workers share on such a machine.

Redirects (301, 302, 303, 307, 308) are followed up to :data:`MAX_REDIRECTS` times; user
information in the URL (``https://user:password@host/...``) is sent as HTTP basic authentication,
also after a redirect within the same origin; paths and queries are percent-encoded where they
are not (spaces, non-ASCII names); HTTPS verifies the server's certificate against the system's
trust store (as aiohttp does). No proxy is used (nor is one by vitflow's fsspec HTTP filesystem).
"""

from __future__ import annotations

import base64
import functools
import http.client
import importlib.metadata
import os
import ssl
import urllib.parse
from pathlib import Path

BLOCK = 1 << 20  # bytes read from the socket at a time, into one reused buffer
MAX_REDIRECTS = 5
CONNECT_TIMEOUT = 10.0  # seconds (the fsspec HTTP filesystem's sock_connect)
TIMEOUT = 60.0  # seconds: each read (its sock_read)
SAFE = "/%:@!$&'()*+,;=~"  # left as they are when a path or query is percent-encoded
REDIRECTS = (301, 302, 303, 307, 308)


class HTTPStatusError(Exception):
    """An answer with an error status: ``status`` (int) and ``message`` (the reason phrase), the
    attributes :func:`vitflow.data.remote.store.with_retries` classifies (5xx, 408 and 429 are
    transient)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status} {message}".strip())
        self.status, self.message = status, message


def is_http(url: str) -> bool:
    """True for an ``http://`` or ``https://`` URL."""
    return urllib.parse.urlsplit(str(url)).scheme.lower() in ("http", "https")


@functools.cache
def _tls() -> ssl.SSLContext:
    """The system's trust store, loaded once per process."""
    return ssl.create_default_context()


@functools.cache
def _user_agent() -> str:
    try:
        return f"vitflow/{importlib.metadata.version('vitflow')}"
    except importlib.metadata.PackageNotFoundError:
        return "vitflow"


def _connect(parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
    """A connected ``HTTP(S)Connection`` to the URL's host (:data:`CONNECT_TIMEOUT` to connect,
    :data:`TIMEOUT` for each read after)."""
    https = parts.scheme.lower() == "https"
    port = parts.port or (443 if https else 80)  # explicit: an IPv6 host would lend its last group as the port
    conn = (http.client.HTTPSConnection(parts.hostname, port, timeout=CONNECT_TIMEOUT, context=_tls()) if https
            else http.client.HTTPConnection(parts.hostname, port, timeout=CONNECT_TIMEOUT))
    conn.connect()
    conn.sock.settimeout(TIMEOUT)
    return conn


def _origin(parts: urllib.parse.SplitResult) -> tuple:
    return parts.scheme.lower(), parts.hostname, parts.port


def _authorization(parts: urllib.parse.SplitResult) -> str | None:
    """``Basic ...`` for a URL with user information, else None."""
    if parts.username is None:
        return None
    user = urllib.parse.unquote(parts.username) + ":" + urllib.parse.unquote(parts.password or "")
    return "Basic " + base64.b64encode(user.encode()).decode("ascii")


def _target(parts: urllib.parse.SplitResult) -> str:
    """The request target: path and query percent-encoded where they are not (as aiohttp sends
    them; existing escapes are kept)."""
    path = urllib.parse.quote(parts.path or "/", safe=SAFE)
    return path + ("?" + urllib.parse.quote(parts.query, safe=SAFE + "?") if parts.query else "")


def _write_body(resp: http.client.HTTPResponse, path: str | Path) -> int:
    """The body of ``resp`` into the file ``path``; returns its bytes. An existing file is written
    over in place and then cut to the body's length: its pages are reused (a spool's recycled
    file, :mod:`vitflow.data.wds.spool`). A body shorter than its ``Content-Length`` raises
    ConnectionError."""
    buf = memoryview(bytearray(BLOCK))
    got = 0
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "wb") as f:
        while n := resp.readinto(buf):
            f.write(buf[:n])
            got += n
        f.truncate(got)
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
        http.client.InvalidURL: a URL that cannot be requested (permanent).
    """
    first = urllib.parse.urlsplit(url)
    for hop in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(url)
        headers = {"Accept-Encoding": "identity", "User-Agent": _user_agent()}
        auth = _authorization(parts) or (_authorization(first) if _origin(parts) == _origin(first) else None)
        if auth:  # the URL's own credentials; a redirect within the same origin keeps them (as aiohttp does)
            headers["Authorization"] = auth
        conn = None
        try:
            conn = _connect(parts)
            conn.request("GET", _target(parts), headers=headers)
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
        except http.client.InvalidURL:
            raise  # a URL that cannot be requested: permanent
        except http.client.HTTPException as e:  # IncompleteRead, BadStatusLine, ...: the transfer broke
            raise ConnectionError(f"{type(e).__name__}: {e}") from e
        finally:
            if conn is not None:
                conn.close()
    raise AssertionError("unreachable")
