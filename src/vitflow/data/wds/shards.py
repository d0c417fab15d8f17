"""WebDataset shards: URL patterns, the tar-member stream grouped into samples and their labels
(the sample-count index and the class list of a shard set: :mod:`vitflow.data.wds.index`).

A shard is an uncompressed (or gzip-compressed) tar whose members come in groups sharing a
**key**: the member name up to the first dot of its basename (``a/b/000012.jpg`` and
``a/b/000012.cls`` are sample ``a/b/000012``), as WebDataset groups them. A sample holds an
image (``.jpg``, ``.jpeg``, ``.png`` or ``.webp``) and a label: ``.cls`` (an integer class
index), ``.json`` (``{"label": index or class name}``) or ``.txt`` (a class name), looked up in
that order.

Reading goes through :mod:`vitflow.data.remote.fs` (``open_stream``, range reads), so local, HTTP
and S3 shards take one code path.
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from vitflow.data.decode import CorruptImageError, image_size
from vitflow.data.remote.fs import BRACE, RemoteError, RemoteFile, is_remote, open_random, open_stream
from vitflow.data.sources import tarscan

log = logging.getLogger(__name__)

INDEX_NAME = "shards.json"
INDEX_KIND = "wids-shard-index-v1"
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "json", "txt")  # in the order a sample's label is looked for
CUT_SAMPLE = "the shard ends inside this sample (truncated?)"  # the error of a sample cut by the shard's end


_SIZES: dict[str, int] = {}  # remote shard sizes, learnt once per process: one request an image, not two


def read_range(url: str, offset: int, size: int) -> bytes:
    """``size`` bytes of the shard ``url`` from ``offset`` (one range request when remote; the
    shard's size is asked once per process). Raises RemoteError."""
    if url not in _SIZES:
        _SIZES[url] = open_random(url).size
    return RemoteFile(url, size=_SIZES[url]).pread(offset, size)


def is_compressed(url: str) -> bool:
    """True for a gzip-compressed shard (``.tar.gz``, ``.tgz``): readable only as a stream."""
    return url.endswith((".gz", ".tgz"))


def has_pattern(spec: str) -> bool:
    """True when ``spec`` is a shard pattern or list: braces, ``::`` or a glob naming ``.tar``."""
    return "::" in spec or bool(BRACE.search(spec)) or (any(c in spec for c in "*?") and ".tar" in spec)


def truncated(url: str, whole: int, count: int, cut: bool, warn: bool = True) -> str:
    """The reason a sample of the shard ``url`` is missing when the shard ends after ``whole``
    complete samples (``cut``: and one more cut short) of the ``count`` its index promised; with
    ``warn``, one warning line naming the shard too."""
    why = f"the shard ends after {whole} whole samples of {count} (truncated?)"
    if warn:
        log.warning("%s: %s%s", url, why, "; one more cut short" * cut)
    return why


def beside(url: str, name: str) -> str:
    """The URL of file ``name`` in the folder of ``url``."""
    return url.rsplit("/", 1)[0] + "/" + name if "/" in url else name


def read_small(url: str) -> bytes | None:
    """The bytes of a small optional file (an index, a class list), or ``None`` when absent (404).

    Raises:
        RemoteError: any other store error (403, unreachable after the retries): a shard set
            whose index cannot be read is not silently scanned instead.
    """
    if not is_remote(url) and not os.path.isfile(url.removeprefix("file://")):
        return None
    try:
        with open_stream(url) as f:
            return f.read()
    except RemoteError as e:
        if e.status == 404:
            return None
        raise


# ---- members and samples ---------------------------------------------------------------------------------------

def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of member ``name``: the key is the name up to the first dot of the
    basename (the folder kept), the extension the rest, lower-cased."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (folder + "/" + stem if folder else stem), ext.lower()


@dataclass
class Sample:
    """One key group of a shard: ``members`` maps extension -> bytes (or ``(offset, size)`` in a
    scan that does not read images); ``error`` says why it is incomplete (truncated shard)."""

    key: str
    members: dict = field(default_factory=dict)
    error: str | None = None

    def image_ext(self) -> str | None:
        return next((e for e in IMAGE_EXTS if e in self.members), None)


def iter_samples(url: str, stream: BinaryIO, read_images: bool = True) -> Iterator[Sample]:
    """The samples of the shard ``url`` in storage order, consecutive members grouped by key.

    Hidden members (a part starting with ``.``), directories and members of no known extension are
    left out. A shard that ends inside a member yields its last, incomplete sample with
    ``error`` set and stops (the samples before it are whole); one that is no tar at all (or empty)
    yields one such sample. With ``read_images=False`` an image member is recorded as
    ``(data offset, size)``; a local file is then scanned through a memory map
    (:mod:`vitflow.data.sources.tarscan`), its images' bytes never read.
    """
    compressed = is_compressed(url)  # offsets then count in the decompressed stream
    mm = None if read_images or compressed else tarscan.mapped(stream)
    if mm is not None:
        with mm:
            yield from _grouped(_scanned(mm), read_images)
        return
    mode = "r:" if not read_images and not compressed and stream.seekable() else "r|*"
    try:
        tf = tarfile.open(fileobj=stream, mode=mode)
    except (tarfile.TarError, EOFError) as e:  # empty (cut at 0) or not a tar: one bad sample, the rest missing
        yield Sample("", error=f"not a readable tar shard ({e})")
        return
    with tf:
        yield from _grouped(((m.name, m.offset_data, m.size, tf.extractfile(m)) for m in tf if m.isfile()), read_images)


class _NotATar(tarfile.ReadError):
    """The first header of a scanned file is no tar header (what ``tarfile.open`` refuses)."""


class _Span:
    """A member's data in the memory map, read on demand; one cut by the end of the file raises
    tarfile.ReadError when read (as tarfile does)."""

    def __init__(self, mm, offset: int, size: int):
        self.mm, self.offset, self.size = mm, offset, size

    def read(self) -> bytes:
        if self.offset + self.size > len(self.mm):
            raise tarfile.ReadError("unexpected end of data")
        return self.mm[self.offset:self.offset + self.size]


def _scanned(mm) -> Iterator[tuple[str, int, int, _Span]]:
    """:func:`tarscan.scan` members as ``(name, offset, size, data)``; after a member cut by the end
    of the file, and for a first header that is no tar header (as ``tarfile.open`` does), raises
    tarfile.ReadError."""
    first = True
    try:
        for name, offset, size in tarscan.scan(mm):
            first = False
            yield name, offset, size, _Span(mm, offset, size)
            if offset + size > len(mm):  # its sample is incomplete, and the last
                raise tarfile.ReadError("unexpected end of data")
    except tarfile.TarError as e:
        if first:
            raise _NotATar(f"not a readable tar shard ({e})") from None
        raise


def _grouped(members, read_images: bool) -> Iterator[Sample]:
    """Samples from ``(name, offset, size, data)`` members (``data``: an object whose ``read()``
    gives the member's bytes, or ``None``)."""
    current: Sample | None = None
    try:
        for name, offset, size, data in members:
            if any(p.startswith(".") for p in name.split("/")):
                continue
            key, ext = split_key(name.removeprefix("./"))
            if ext not in IMAGE_EXTS and ext not in LABEL_EXTS:
                continue
            if current is None or key != current.key:
                if current is not None:
                    yield current
                current = Sample(key)
            if ext in IMAGE_EXTS and not read_images:
                current.members[ext] = (offset, size)
            else:
                current.members[ext] = data.read() if data is not None else b""
    except (tarfile.TarError, EOFError) as e:  # a read error of the store (RemoteError) propagates
        if isinstance(e, _NotATar):
            yield Sample("", error=str(e))
            return
        current = current or Sample("?")
        current.error = f"{CUT_SAMPLE}: {e}"
    if current is not None:
        yield current


def first_image_sizes(url: str, n: int) -> list[tuple[int, int]]:
    """``(width, height)`` in pixels of up to ``n`` images from the start of the shard ``url``, from
    their headers: what a training plan samples, without reading the whole split (which a remote
    shard set would download). Unreadable samples are left out. Raises RemoteError."""
    sizes = []
    with open_stream(url) as f:
        for s in iter_samples(url, f):
            ext = s.image_ext()
            if s.error is None and ext is not None:
                try:
                    sizes.append(image_size(s.members[ext], f"{url}:{s.key}"))
                except CorruptImageError:
                    pass
            if len(sizes) >= n:
                break
    return sizes


def parse_label(sample: Sample, classes: list[str] | None) -> int | str:
    """The class index of ``sample`` (``.cls``, ``.json`` ``{"label": ...}``, or ``.txt``), or
    the class name when ``classes`` is ``None`` and the label is a name.

    Raises:
        ValueError: no label member, or one that is not an index < ``len(classes)`` nor one of
            ``classes`` (the message says which).
    """
    ext = next((e for e in LABEL_EXTS if e in sample.members), None)
    if ext is None:
        raise ValueError("no label file (.cls, .json or .txt)")
    raw = sample.members[ext].decode("utf-8", "replace").strip()
    value: int | str = raw
    if ext == "json":
        try:
            value = json.loads(raw)["label"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f".json label is not {{\"label\": ...}}: {raw[:60]!r}") from None
    if ext == "cls" or (isinstance(value, str) and ext == "json" and value.strip().lstrip("-").isdigit()):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f".cls label {raw[:60]!r} is not an integer") from None
    if isinstance(value, int) and not isinstance(value, bool):
        if classes is not None and not 0 <= value < len(classes):
            raise ValueError(f"class index {value} outside 0..{len(classes) - 1}")
        return value
    name = str(value).strip()
    if classes is None:
        return name
    try:
        return classes.index(name)
    except ValueError:
        raise ValueError(f"class {name!r} is not in the class list") from None


def looks_like_shard(path: str, members: int = 16) -> bool:
    """True when the first ``members`` members of the tar at ``path`` group by key into an image
    and a label (``.cls``/``.json``/``.txt``): WebDataset members, not a tar of class folders."""
    try:
        with open_stream(path) as f, tarfile.open(fileobj=f, mode="r|*") as tf:
            groups: dict[str, set[str]] = {}
            for i, m in enumerate(tf):
                if i == members:
                    break
                if m.isfile():
                    key, ext = split_key(m.name)
                    groups.setdefault(key, set()).add(ext)
    except (tarfile.TarError, OSError, EOFError):
        return False
    return any(exts & set(IMAGE_EXTS) and exts & set(LABEL_EXTS) for exts in groups.values())

