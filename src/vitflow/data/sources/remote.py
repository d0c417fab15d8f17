"""The kind of data at a URL (``data.path=https://...`` / ``s3://...``), for
:func:`vitflow.data.sources.dispatch.source_kind`: the kinds whose record has a ``remote`` test
(today a ``.tar`` read in place by range requests, a label file (``.csv`` / ``.tsv`` /
``.jsonl``) read whole, or a packed dataset (a ``meta.json`` under the URL) read by range
requests). Stores are not listed for these kinds, so remote image folders are not supported:
pack them (``vitflow prepare``) or tar them.
"""

from __future__ import annotations

from collections.abc import Sequence

from vitflow.data.sources.base import DataError
from vitflow.data.sources.kind import SourceKind

READABLE = "remote data can be a .tar, a label file (.csv, .tsv, .jsonl) or a packed dataset (vitflow prepare)"


def remote_kind(url: str, kinds: Sequence[SourceKind], source: str = "auto", label: str = "data.path") -> SourceKind:
    """The kind among ``kinds`` of the data at ``url``: the first whose ``remote`` test holds, the
    tests of names before those that make a request (``source``, when not ``auto``: that kind,
    after checking it can be read from a URL, and that the URL holds it when its test is a request).

    Raises:
        DataError: a kind that cannot be read from a URL, or a URL that names none of these.
        RemoteError: the store stayed unreachable or refused (403) the request.
    """
    readable = [k for k in kinds if k.remote is not None]
    if source != "auto":
        kind = next((k for k in readable if k.name == source), None)
        if kind is None:
            raise DataError(f"{label} {url}: data.source={source} cannot be read from a URL; {READABLE}")
        if not kind.remote_probes or kind.remote(url):
            return kind
    else:
        for kind in sorted(readable, key=lambda k: k.remote_probes):  # name tests first: no request for a .tar
            if kind.remote(url):
                return kind
    raise DataError(f"{label} {url} is not a packed dataset (no meta.json of one under it), a .tar or a label "
                    "file (.csv, .tsv, .jsonl); remote folders cannot be listed: pack or tar them first")
