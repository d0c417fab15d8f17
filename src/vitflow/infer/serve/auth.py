"""API keys for ``vitflow serve``: who may call the model.

Keys come from ``--api-key-file FILE`` (one key per line; blank lines and ``#`` comments skipped)
and from the environment variable ``VITFLOW_SERVE_API_KEYS`` (comma-separated). In memory each key
is only its SHA-256 digest, and a presented key's digest is compared with every one of them by
``hmac.compare_digest`` (constant time, no early exit: the answer's timing says nothing of how
much of a key was right). The file is read again on ``SIGHUP`` (:meth:`ApiKeys.reload`: a file
that became unreadable or empty keeps the keys in force, and says so).

A request presents its key as ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``. The page
(``/``), ``/healthz``, ``/readyz``, the API schema (``/docs``, ``/openapi.json``) and, with
``--metrics-open``, ``/metrics`` need none; every other path answers 401 without a valid key.
Failed attempts are counted (``vitflow_serve_auth_failures_total``, by reason) and limited per
client address: past ``--auth-failures`` (default :data:`FAILURES`) within :data:`WINDOW_S`
seconds, that address gets 429 with ``Retry-After`` until the window has passed (per worker
process; behind a proxy every client has the proxy's address: ``--auth-failures 0`` there, and
limit at the proxy).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

log = logging.getLogger("vitflow.serve")

KEYS_ENV = "VITFLOW_SERVE_API_KEYS"
MIN_KEY_CHARS = 16  # a shorter key is guessable by the rate-limited attempts of many addresses
FAILURES, WINDOW_S = 10, 60.0  # failed attempts from one address, and the window they are counted in
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/openapi.json",
                        "/favicon.ico"})
ADDRESSES = 10_000  # client addresses whose failures are remembered (the oldest forgotten first)


class KeyFileError(ValueError):
    """The keys cannot be read: the message names the file or variable and what is wrong."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_keys(path: str | None, env: str | None = None) -> list[bytes]:
    """The SHA-256 digests of the keys in file ``path`` and in the comma-separated ``env`` value.

    Raises:
        KeyFileError: an unreadable file, a file with no key, or a key shorter than
            :data:`MIN_KEY_CHARS` characters (named by its line, never echoed).
    """
    keys: list[tuple[str, str]] = []
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise KeyFileError(f"--api-key-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        keys += [(f"--api-key-file {path} line {i}", line.strip()) for i, line in enumerate(lines, 1)
                 if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise KeyFileError(f"--api-key-file {path}: no key in it (one key per line)")
    if env:
        keys += [(f"{KEYS_ENV} key {i}", k.strip()) for i, k in enumerate(env.split(","), 1) if k.strip()]
    for where, key in keys:
        if len(key) < MIN_KEY_CHARS:
            raise KeyFileError(f"{where}: a key of {len(key)} characters; use at least {MIN_KEY_CHARS} (e.g. "
                               "python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return [_digest(k) for _, k in keys]


class ApiKeys:
    """The keys in force: digests of ``path``'s and ``$VITFLOW_SERVE_API_KEYS``'s keys.

    Raises:
        KeyFileError: as :func:`read_keys`, at construction.
    """

    def __init__(self, path: str | None, env: str | None):
        self.path, self.env = path, env
        self.digests = read_keys(path, env)

    def reload(self) -> int:
        """Read the file again (``SIGHUP``); returns the number of keys in force. A file that cannot
        be read, or holds no valid key, leaves the keys as they were (logged)."""
        try:
            self.digests = read_keys(self.path, self.env)
            log.info("API keys reloaded: %d key(s) in force", len(self.digests))
        except KeyFileError as e:
            log.error("API keys not reloaded, the %d in force kept: %s", len(self.digests), e)
        return len(self.digests)

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the keys (constant time over all of them)."""
        d, ok = _digest(key), False
        for known in self.digests:
            ok |= hmac.compare_digest(d, known)
        return ok


class FailureLimit:
    """Failed attempts per client address in a sliding window of ``window`` seconds; an address
    past ``limit`` of them is refused until its oldest one leaves the window."""

    def __init__(self, limit: int = FAILURES, window: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.limit, self.window, self.clock = limit, window, clock
        self.failures: OrderedDict[str, deque] = OrderedDict()

    def _recent(self, address: str) -> deque:
        q = self.failures.get(address) or deque()
        while q and q[0] <= self.clock() - self.window:
            q.popleft()
        return q

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        q = self._recent(address)
        return max(0.0, q[0] + self.window - self.clock()) if len(q) >= self.limit else 0.0

    def record(self, address: str) -> None:
        q = self._recent(address)
        q.append(self.clock())
        self.failures[address] = q
        self.failures.move_to_end(address)
        while len(self.failures) > ADDRESSES:
            self.failures.popitem(last=False)


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    """The key of ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``; ``None`` without one."""
    auth = headers.get(b"authorization", b"").decode("latin-1").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get(b"x-api-key", b"").decode("latin-1").strip() or None


class RequireKey:
    """ASGI middleware: a request to a path outside the open ones passes with a valid key; else
    401 (``WWW-Authenticate: Bearer``) or, for an address past its failures, 429 (``Retry-After``),
    answered as every error of the service (``{"error", "kind", "status"}``) and counted by
    ``count(reason)``."""

    def __init__(self, app, keys: ApiKeys, open_paths: frozenset[str], count: Callable[[str], None],
                 failures: int = FAILURES):
        self.app, self.keys, self.open_paths, self.count = app, keys, open_paths, count
        self.limit = FailureLimit(failures) if failures else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        address = (scope.get("client") or ("-", 0))[0]
        wait = self.limit.retry_after(address) if self.limit else 0.0
        if wait > 0:
            self.count("limited")
            scope.setdefault("state", {})["error_kind"] = "rate_limited"
            return await _refuse(send, 429, "rate_limited", f"too many failed API key attempts from {address}: "
                                 f"try again in {wait:.0f} s", {"retry-after": str(max(1, round(wait)))})
        headers = dict(scope["headers"])
        key = presented_key(headers)
        if key is not None and self.keys.accepts(key):
            return await self.app(scope, receive, send)
        if self.limit:
            self.limit.record(address)
        self.count("missing" if key is None else "wrong")
        if key is not None:
            why = "the API key is not accepted"
        elif headers.get(b"authorization"):
            why = "Authorization without the Bearer scheme: send Authorization: Bearer KEY (or X-API-Key: KEY)"
        else:
            why = "no API key: send Authorization: Bearer KEY or X-API-Key: KEY"
        scope.setdefault("state", {})["error_kind"] = "unauthorized"  # the access log's kind
        return await _refuse(send, 401, "unauthorized", why, {"www-authenticate": "Bearer"})


async def _refuse(send, status: int, kind: str, message: str, headers: dict[str, str]) -> None:
    body = json.dumps({"error": message, "kind": kind, "status": status}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           *[(k.encode(), v.encode()) for k, v in headers.items()]]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def keys_from_env() -> str | None:
    return os.environ.get(KEYS_ENV) or None
