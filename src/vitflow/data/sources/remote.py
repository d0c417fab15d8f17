"""The kind of data at a URL (``data.path=https://...`` / ``s3://...``), for
:func:`vitflow.data.sources.dispatch.source_kind`: a ``.tar`` read in place by range requests, a label file
(``.csv`` / ``.tsv`` / ``.jsonl``) read whole, or a packed dataset (a ``meta.json`` under the URL)
read by range requests. Stores are not listed for these kinds, so remote image folders are not
supported: pack them (``vitflow prepare``) or tar them.
"""

from __future__ import annotations

from vitflow.data.remote.fs import basename
from vitflow.data.sources.base import DataError
from vitflow.data.sources.labelfile import EXTENSIONS
from vitflow.data.sources.packed import is_packed

REMOTE_KINDS = ("tar", "packed", "labels")


def remote_kind(url: str, source: str = "auto", label: str = "data.path") -> str:
    """``tar``, ``labels`` or ``packed`` for the URL ``url`` (``source``, when not ``auto``, after
    checking the kind can be read remotely).

    Raises:
        DataError: a kind that cannot be read from a URL, or a URL that names none of these.
        RemoteError: the store stayed unreachable or refused (403) the request.
    """
    name = basename(url).lower()
    if source not in ("auto", *REMOTE_KINDS):
        raise DataError(f"{label} {url}: data.source={source} cannot be read from a URL; remote data can be a .tar, "
                        "a label file (.csv, .tsv, .jsonl) or a packed dataset (vitflow prepare)")
    if source == "packed" or (source == "auto" and not name.endswith((".tar", *EXTENSIONS))):
        if is_packed(url):
            return "packed"
        raise DataError(f"{label} {url} is not a packed dataset (no meta.json of one under it), a .tar or a label "
                        "file (.csv, .tsv, .jsonl); remote folders cannot be listed: pack or tar them first")
    if source != "auto":
        return source
    return "tar" if name.endswith(".tar") else "labels"
