"""Tar member headers read straight from a memory map: ``(name, data offset, size)`` of each
regular file, without reading the members' data — what a training stream needs to hand image
offsets to its loader workers, at a fraction of :mod:`tarfile`'s per-member cost (a header is
one slice of the map instead of a seek, a read and a ``TarInfo``).

The formats are POSIX ustar (the ``prefix`` field), GNU (``L`` long-name members) and pax
(``x`` extended headers: ``path`` and ``size``; ``g`` global headers are skipped), the ones
:mod:`tarfile`, GNU tar and WebDataset's writers produce. Each header's checksum is verified as
:mod:`tarfile` verifies it (unsigned or signed byte sum). Compressed tars are not read here.
"""

from __future__ import annotations

import mmap
import tarfile
from typing import BinaryIO, Iterator

BLOCK = 512
REGULAR = (b"0", b"\0", b"7")  # regular file, old-style regular file, contiguous file


def _number(field: bytes) -> int:
    """A header number: octal digits (NUL/space padded), or base-256 when the first byte has
    its high bit set (GNU, for sizes >= 8 GiB). Raises tarfile.HeaderError."""
    if field[0] & 0x80:
        return int.from_bytes(field[1:], "big") | ((field[0] & 0x7F) << (8 * (len(field) - 1)))
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise tarfile.HeaderError(f"invalid number field {field!r}") from None


def _checked(header: bytes) -> None:
    """Raises tarfile.HeaderError when ``header``'s checksum is wrong."""
    stored = _number(header[148:156])
    unsigned = sum(header[:148]) + 256 + sum(header[156:])
    if stored != unsigned:
        signed = unsigned - 2 * (sum(b for b in header[:148] if b > 127) + sum(b for b in header[156:] if b > 127))
        if stored != signed:
            raise tarfile.HeaderError("bad checksum")


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``length key=value\\n`` records of a pax extended header."""
    out, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] not in (b"\0", b""):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def scan(buf) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each regular-file member of the tar in ``buf`` (bytes, a
    memoryview or an ``mmap``), in order. Stops at the end-of-archive block, at the end of
    ``buf``, or where ``buf`` ends inside a header or a long-name / pax record (as :mod:`tarfile`
    stops there): the members before it are given; a regular member cut by the end is given with
    its full size (its data runs past ``len(buf)``).

    Raises:
        tarfile.HeaderError: a header with a wrong checksum or an unreadable number.
    """
    pos, end, long_name, pax = 0, len(buf), None, {}
    while pos < end:
        header = bytes(buf[pos:pos + BLOCK])
        if len(header) < BLOCK or header.count(0) == BLOCK:
            return
        _checked(header)
        size, kind = _number(header[124:136]), header[156:157]
        if "size" in pax and kind not in (b"x", b"g", b"L"):
            size = int(pax["size"])
        data = pos + BLOCK
        pos = data + -(-size // BLOCK) * BLOCK
        if kind in (b"L", b"x", b"g") and data + size > end:
            return
        if kind == b"L":
            long_name = bytes(buf[data:data + size]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind in (b"x", b"g"):
            if kind == b"x":
                pax = _pax_records(bytes(buf[data:data + size]))
            continue
        name = header[:100].split(b"\0", 1)[0]
        if header[257:263] == b"ustar\0" and (prefix := header[345:500].split(b"\0", 1)[0]):
            name = prefix + b"/" + name
        name = pax.get("path") or long_name or name.decode("utf-8", "surrogateescape")
        long_name, pax = None, {}
        if kind in REGULAR:
            yield name, data, size


def mapped(f: BinaryIO) -> mmap.mmap | None:
    """A read-only memory map of the open file ``f``, or ``None`` (empty, or not mappable)."""
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, AttributeError):
        return None
