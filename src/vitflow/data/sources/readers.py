"""Readers: a relative path (or a tar member) -> its bytes.

Members of a tar are indexed once (name, data offset, size) and then read by offset with
``os.pread``: no extraction, no per-image file open, safe to share across forked workers.
Hidden entries (names starting with ``.``) and ``__MACOSX`` are left out of every listing.

File names are kept as the operating system gives them: a name that is not valid UTF-8 is a
``str`` with surrogate escapes (``os.fsdecode``), stored as its original bytes (``os.fsencode``),
and shown in messages by :func:`display_name` (``caf\\xe9.jpg``).
"""

from __future__ import annotations

import logging
import os
import tarfile
from pathlib import Path

from vitflow.data.remote.fs import is_remote, join, open_random, read_bytes
from vitflow.data.sources.base import DataError

log = logging.getLogger(__name__)
TAIL_CHECK = 1 << 16  # bytes after a tar's last member checked to be its end-of-archive zeros


def display_name(name: str | os.PathLike) -> str:
    """``name`` printable: bytes that are not valid UTF-8 (surrogate escapes in a ``str``) shown as
    ``\\xNN``, so a message naming the file never fails to print."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def is_hidden(part: str) -> bool:
    return part.startswith(".") or part == "__MACOSX"


class FolderReader:
    """Reads files under a directory ``root`` (or a URL prefix: each file one remote read; not listed)."""

    def __init__(self, root: Path | str):
        self.root = root

    def describe(self, rel: str) -> str:
        if is_remote(rel) or is_remote(self.root):
            return display_name(rel if is_remote(rel) else join(self.root, rel))
        return display_name(self.root / rel)

    def list(self) -> tuple[dict[str, object], set[str]]:
        files: dict[str, object] = {}
        dirs: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            dirs.update(rel_dir + d for d in dirnames)
            for f in filenames:
                if not is_hidden(f):
                    files[rel_dir + f] = rel_dir + f
        return files, dirs

    def read(self, locator: object) -> bytes:
        if is_remote(locator) or is_remote(self.root):
            return read_bytes(str(locator) if is_remote(locator) else join(self.root, str(locator)))
        with open(self.root / str(locator), "rb") as f:
            return f.read()


_TAR_INDEX: dict[tuple, tuple[dict[str, object], set[str]]] = {}


class TarReader:
    """Reads members of an uncompressed tar by byte offset (``os.pread``; a remote ``path``, such as
    ``https://...`` or ``s3://...``, by range requests through :func:`vitflow.data.remote.fs.open_random`)."""

    def __init__(self, path: Path | str):
        self.path = path
        self.remote = is_remote(path)
        self._fd: int | None = None
        self._file = None
        self._pid = -1

    def describe(self, rel: str) -> str:
        return display_name(f"{self.path}:{rel}")

    def _size(self) -> int:
        return self._remote_file().size if self.remote else self.path.stat().st_size

    def _remote_file(self):
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open_random(str(self.path)), os.getpid()
        return self._file

    def list(self) -> tuple[dict[str, object], set[str]]:
        if self.remote:
            key = (str(self.path), self._size(), 0)
        else:
            st = self.path.stat()
            key = (str(self.path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in _TAR_INDEX:  # index each archive once per process
            _TAR_INDEX.clear()
            _TAR_INDEX[key] = self._index()
        return _TAR_INDEX[key]

    def _index(self) -> tuple[dict[str, object], set[str]]:
        files: dict[str, object] = {}
        dirs: set[str] = set()
        try:
            with tarfile.open(fileobj=open_random(str(self.path)), mode="r:") if self.remote else \
                    tarfile.open(self.path, "r:") as tf:
                for m in tf:
                    name = m.name.removeprefix("./")
                    if any(is_hidden(p) for p in name.split("/")):
                        continue
                    parts = name.split("/")
                    dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
                    if m.isdir():
                        dirs.add(name.rstrip("/"))
                    elif m.isfile():
                        files[name] = (m.offset_data, m.size)
                end = tf.offset  # where the members end: the end-of-archive blocks of a complete tar
        except tarfile.ReadError as e:
            raise DataError(f"{self.path}: not an uncompressed tar archive ({e}); compressed tars cannot be "
                            f"read by offset: decompress it first") from None
        self._check_end(end, len(files))
        return files, dirs

    def _check_end(self, end: int, members: int) -> None:
        """Warn when the archive does not end as a tar does (zero blocks after the last member): cut
        exactly at a member boundary, it would otherwise read as a smaller dataset without a word."""
        size = self._size()
        if end >= size:
            log.warning("%s ends right after its last member, without the end-of-archive blocks: it may have been "
                        "cut short (%d files read)", display_name(self.path), members)
            return
        if self.remote:
            tail = self._remote_file().pread(end, min(size - end, TAIL_CHECK))
        else:
            with open(self.path, "rb") as f:
                f.seek(end)
                tail = f.read(min(size - end, TAIL_CHECK))
        if tail.strip(b"\0"):
            log.warning("%s: %d bytes after the last member are not the zeros that end a tar: a damaged or "
                        "concatenated archive? (%d files read)", display_name(self.path), size - end, members)

    def read(self, locator: object) -> bytes:
        offset, size = locator  # type: ignore[misc]
        if self.remote:
            return self._remote_file().pread(offset, size)
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self._fd, size, offset)

    def __getstate__(self) -> dict:
        return {"path": self.path, "remote": self.remote, "_fd": None, "_file": None, "_pid": -1}
