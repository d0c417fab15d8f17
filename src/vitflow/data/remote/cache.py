"""A size-bounded local cache of remote files (``data.cache_dir``, ``data.cache_max_size``).

A file is downloaded whole into ``CACHE_DIR/.NAME.PID.partial``, flushed to disk and renamed to
``CACHE_DIR/NAME`` (``NAME``: a hash of the URL and its file name), so a killed run never leaves a
partial file that a later run takes for complete. Each use touches the file (its modification
time is the last use); after a download the least recently used files are deleted until the
cache fits ``cache_max_size`` (the file just fetched is always kept, even when it alone is larger).
Left-over ``.partial`` files of dead downloads older than :data:`STALE_PARTIAL` seconds go too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

from vitflow.data.remote.http import get_file as http_get_file
from vitflow.data.remote.http import is_http
from vitflow.data.remote.store import basename, file_size, filesystem, with_retries

log = logging.getLogger(__name__)
STALE_PARTIAL = 24 * 3600  # seconds
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
         "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10,
         "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int | None) -> int | None:
    """``"20GiB"`` -> 21474836480 bytes (B, KB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB of 1024);
    ``None`` / ``""`` -> ``None`` (unbounded).

    Raises:
        ValueError: not a number with one of those units.
    """
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size such as 500MB or 20GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def cache_name(url: str) -> str:
    """The cached file's name for ``url``: 16 hex digits of its SHA-256 and its own file name."""
    return f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{basename(url)[-80:]}"


def download(url: str, path: str | Path) -> int:
    """Copy the remote file ``url`` into the local file ``path`` (created or overwritten): one
    streamed request (HTTP(S): :func:`vitflow.data.remote.http.get_file`; other stores: their
    fsspec ``get_file``), checked against the file's size and, on a transient error, retried
    from the start as :func:`~vitflow.data.remote.store.with_retries` says. Returns the bytes
    written. Raises RemoteError."""
    fs, size = filesystem(url), file_size(url)

    def get() -> int:
        if is_http(url):
            http_get_file(url, path)
        else:
            fs.get_file(url, str(path))
        got = os.path.getsize(path)
        if got != size:
            raise ConnectionError(f"short read: {got} of {size} bytes")
        return got

    return with_retries(url, "download", get)


def cached_copy(url: str, cache_dir: str, max_size: int | None) -> Path:
    """The local copy of ``url`` in ``cache_dir`` (created), downloaded first (:func:`download`)
    when absent.

    Raises:
        RemoteError: the download failed (nothing is left under the final name).
        OSError: the cache folder cannot be written.
    """
    folder = Path(cache_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / cache_name(url)
    if path.is_file():
        os.utime(path)  # the last use, for the LRU order
        return path
    tmp = folder / f".{path.name}.{os.getpid()}.partial"
    try:
        size = download(url, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: the name appears only for a complete file
    finally:
        tmp.unlink(missing_ok=True)
    log.debug("cached %s as %s (%d bytes)", url, path, size)
    evict(folder, max_size, keep=path)
    return path


def evict(folder: Path, max_size: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the least recently used files of ``folder`` until it holds at most ``max_size``
    bytes (``keep`` stays), and ``.partial`` files older than :data:`STALE_PARTIAL`. Returns the
    deleted paths."""
    import time

    removed, entries = [], []
    now = time.time()
    for p in folder.iterdir():
        try:
            st = p.stat()
        except FileNotFoundError:  # another process removed it meanwhile
            continue
        if p.name.endswith(".partial"):
            if now - st.st_mtime > STALE_PARTIAL:
                p.unlink(missing_ok=True)
                removed.append(p)
        elif p.is_file():
            entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if max_size is None or total <= max_size:
            break
        if keep is not None and p == keep:
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
        total -= size
    if removed:
        log.info("data.cache_dir %s: removed %d least recently used file(s) to stay within %s bytes", folder,
                 len(removed), max_size)
    return removed
