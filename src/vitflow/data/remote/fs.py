"""Remote storage: ``s3://``, ``gs://``, ``http(s)://`` and ``hf://`` paths read through fsspec.

- :func:`open_stream` gives a sequential binary stream (WebDataset shards, label files, small
  metadata files); :func:`open_random` a seekable file with :meth:`RemoteFile.pread` range reads
  (packed datasets, tar-in-place). Local paths open with plain ``open()``.
- Every request to a store is retried on transient errors (connection refused / reset, timeouts,
  HTTP 5xx and 429, S3 ``SlowDown`` / 5xx) with exponential backoff and jitter
  (``data.remote_retries`` attempts after the first, the first wait ``data.remote_backoff``
  seconds, doubling up to :data:`MAX_BACKOFF`); never on 403 / 404, a TLS certificate the client
  does not trust or a host name that does not resolve (a resolver that cannot answer now is
  retried). A failure raises
  :class:`RemoteError`, one line naming the URL and the HTTP / S3 error.
- Credentials come from each store's usual environment: ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_DEFAULT_REGION`` and, for
  S3-compatible servers (MinIO, Ceph, moto), ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``;
  ``GOOGLE_APPLICATION_CREDENTIALS`` for gs://; ``HF_TOKEN`` for hf://.
- ``data.cache_dir`` keeps whole files read by :func:`open_stream` in a size-bounded local cache
  (:mod:`vitflow.data.remote.cache`).

The settings live in this module (:func:`configure`, called when a run's data is opened); loader
workers are forked and inherit them.
"""

from __future__ import annotations

import io
import logging
import os
import re
from glob import glob
from typing import BinaryIO

import numpy as np

from vitflow.config import DataConfig
from vitflow.data.remote.cache import cached_copy, parse_size
from vitflow.data.remote.store import (  # noqa: F401  the public names of remote I/O live here
    RANDOM_BLOCK,
    SCHEME,
    SETTINGS,
    STREAM_BLOCK,
    RemoteError,
    basename,
    configure,
    exists,
    file_size,
    filesystem,
    is_remote,
    join,
    local_path,
    parent,
    with_retries,
)
from vitflow.data.sources.base import DataError

log = logging.getLogger(__name__)

__all__ = ["RANDOM_BLOCK", "SCHEME", "SETTINGS", "STREAM_BLOCK", "RangeArray", "RemoteError", "RemoteFile", "basename",
           "configure", "configure_from", "exists", "expand_braces", "expand_urls", "file_size", "filesystem",
           "is_remote", "join", "load_npy", "local_path", "open_random", "open_stream", "parent", "read_bytes", "with_retries"]


def configure_from(cfg: DataConfig) -> None:
    """Apply a :class:`~vitflow.config.DataConfig`'s ``remote_retries``, ``remote_backoff``,
    ``cache_dir`` and ``cache_max_size`` to this process (and the loader workers it forks)."""
    configure(cfg.remote_retries, cfg.remote_backoff, cfg.cache_dir, parse_size(cfg.cache_max_size))


_NO_RANGES: set[str] = set()  # the hosts found ignoring Range requests (warned once each)


def _warn_no_ranges(url: str, size: int) -> None:
    host = SCHEME.sub("", url).split("/", 1)[0]
    if host not in _NO_RANGES:
        _NO_RANGES.add(host)
        log.warning("%s: the server ignores Range requests: every read downloads the whole file (%d bytes); serve "
                    "the files with one that answers them (nginx, Apache, S3 ...)", url, size)


class RemoteFile(io.RawIOBase):
    """A read-only, seekable remote file read by range requests (``block`` bytes at least per
    request, kept as a read-ahead buffer), each retried as :func:`with_retries` says.

    :meth:`pread` reads a span without moving the position or the buffer (one request): what
    tar-in-place members and packed images use. Picklable: a loader worker reopens its own
    connection.
    """

    def __init__(self, url: str, block: int = RANDOM_BLOCK, size: int | None = None):
        super().__init__()
        self.url, self.name, self.block = url, url, block
        self._size, self._pos, self._buf, self._buf_at = size, 0, b"", 0

    def __getstate__(self) -> dict:
        return {"url": self.url, "block": self.block, "size": self._size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["block"], state["size"])

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = file_size(self.url)
        return self._size

    def _fetch(self, start: int, end: int) -> bytes:
        fs = filesystem(self.url)

        def get() -> bytes:
            data = fs.cat_file(self.url, start=start, end=end)
            if len(data) == self.size and end - start != self.size:  # a server that ignores Range
                _warn_no_ranges(self.url, self.size)
                data = data[start:end]
            if len(data) != end - start:
                raise ConnectionError(f"short read: {len(data)} of {end - start} bytes at offset {start}")
            return data

        return with_retries(self.url, f"read of bytes {start}-{end - 1}", get)

    def pread(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer at the end of the file). Raises RemoteError."""
        end = min(offset + size, self.size)
        return self._fetch(offset, end) if end > offset else b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        if self._pos >= self.size:
            return 0
        view = memoryview(b).cast("B")
        offset = self._pos - self._buf_at
        if not 0 <= offset < len(self._buf):
            end = min(self.size, self._pos + max(self.block, len(view)))
            self._buf, self._buf_at, offset = self._fetch(self._pos, end), self._pos, 0
        n = min(len(view), len(self._buf) - offset)
        view[:n] = self._buf[offset:offset + n]
        self._pos += n
        return n


def open_stream(url: str, cache_dir: str | None = None) -> BinaryIO:
    """A sequential binary stream of ``url`` (local path, ``file://``, ``http(s)://``, ``s3://``,
    ``gs://``, ``hf://``), read ``STREAM_BLOCK`` bytes a request, each request retried. With
    ``cache_dir`` (default: ``data.cache_dir``) a remote file is first copied whole into the local
    cache (:func:`vitflow.data.remote.cache.cached_copy`) and read from there.

    Raises:
        RemoteError: the store answered 403 / 404, or stayed unreachable through the retries.
        OSError: a local file that cannot be opened.
    """
    if not is_remote(url):
        return open(local_path(url), "rb")
    cache_dir = cache_dir or SETTINGS.cache_dir
    if cache_dir:
        return open(cached_copy(url, cache_dir, SETTINGS.cache_max_size), "rb")
    return io.BufferedReader(RemoteFile(url, STREAM_BLOCK), buffer_size=1 << 16)


def open_random(url: str) -> RemoteFile | BinaryIO:
    """``url`` for random access: a local file opened with ``open()``, or a :class:`RemoteFile`
    (range reads; :meth:`RemoteFile.pread`). Raises RemoteError (see :func:`open_stream`)."""
    if not is_remote(url):
        return open(local_path(url), "rb")
    f = RemoteFile(url)
    f.size  # noqa: B018 - fail here, naming the URL, rather than at the first read
    return f


class RangeArray:
    """A read-only C-order array ``shape`` of ``dtype`` stored in the remote file ``url``, read by
    range requests: ``a[i]`` (one row), ``a[i:j]`` (contiguous rows, one request), ``a[rows]`` (an
    index array: one request a row). Stands in for the ``np.memmap`` of a local packed dataset."""

    def __init__(self, url: str, shape: tuple[int, ...], dtype=np.uint8):
        self.file, self.shape, self.dtype = RemoteFile(url), tuple(shape), np.dtype(dtype)
        self.row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step != 1:
                raise IndexError("RangeArray slices take contiguous rows only")
            n = max(0, stop - start)
            data = self.file.pread(start * self.row, n * self.row) if n else b""
            return np.frombuffer(data, self.dtype).reshape((n, *self.shape[1:]))
        if np.ndim(key) == 0:
            return self[int(key):int(key) + 1][0]
        rows = [self[int(r)] for r in np.asarray(key).reshape(-1)]
        return np.stack(rows) if rows else np.empty((0, *self.shape[1:]), self.dtype)


def load_npy(path: str) -> np.ndarray:
    """A ``.npy`` array: memory-mapped when local, read whole when remote. Raises RemoteError."""
    if not is_remote(path):
        return np.load(local_path(path), mmap_mode="r")
    return np.load(io.BytesIO(read_bytes(path)))


def read_bytes(url: str) -> bytes:
    """The whole file ``url`` (local or remote). Raises RemoteError, OSError."""
    with open_stream(url) as f:
        return f.read()


# -- shard lists ----------------------------------------------------------------------------------

BRACE = re.compile(r"\{([^{}]*)\}")


def _named(key: str | None) -> str:
    return f"{key}: " if key else ""


def expand_braces(pattern: str, key: str | None = "data.path") -> list[str]:
    """``a-{000..002}.tar`` -> ``a-000.tar, a-001.tar, a-002.tar`` (zero-padded to the width of a
    bound written with a leading zero); ``{x,y}`` lists; several braces expand left to right.

    Raises:
        DataError: a range whose bounds are not integers or that runs backwards.
    """
    m = BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[:m.start()], pattern[m.end():]
    if ".." in body:
        lo, _, hi = body.partition("..")
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise DataError(f"{_named(key)}brace range {{{body}}} in {pattern!r} is not {{FIRST..LAST}} with "
                            "integers FIRST <= LAST")
        width = len(lo) if lo.startswith("0") or hi.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [x for item in items for x in expand_braces(head + item + tail, key)]


def expand_urls(spec: str, key: str | None = "data.path") -> list[str]:
    """The files a shard spec names, in order: patterns joined by ``::`` (WebDataset's separator),
    each brace-expanded (:func:`expand_braces`); ``*`` / ``?`` / ``[...]`` globbed, sorted (local
    paths, and stores that list: s3://, gs://, hf://; not http(s)://). ``key``: the config key the
    spec came from, which begins an error's message (``None``: the caller names it).

    Raises:
        DataError: a pattern that matches nothing (a local brace pattern with missing files names
            the first), or a glob over http(s).
        RemoteError: the store's listing failed.
    """
    out: list[str] = []
    for pattern in (p.strip() for p in str(spec).split("::")):
        if not pattern:
            continue
        names = []
        for item in expand_braces(pattern, key):
            if not any(c in item for c in "*?["):
                names.append(item)
            elif not is_remote(item):
                names += sorted(glob(local_path(item)))
            elif item.lower().startswith(("http://", "https://")):
                raise DataError(f"{_named(key)}{item!r}: HTTP servers cannot be listed; name the shards with a "
                                "brace pattern such as train-{000000..000127}.tar")
            else:
                fs, scheme = filesystem(item), SCHEME.match(item).group(1)
                found = with_retries(item, "listing", lambda: fs.glob(item))
                names += sorted(f if SCHEME.match(f) else f"{scheme}://{f}" for f in found)
        missing = [n for n in names if not is_remote(n) and not os.path.isfile(local_path(n))]
        if not names or len(missing) == len(names):
            raise DataError(f"{_named(key)}pattern {pattern} matched no shard")
        if missing:
            raise DataError(f"{_named(key)}shard {missing[0]} (from pattern {pattern}) does not exist "
                            f"({len(missing)} of {len(names)} missing)")
        out += names
    if not out:
        raise DataError(f"{_named(key)}pattern {spec} matched no shard")
    return out
