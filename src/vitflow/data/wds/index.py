"""The sample-count index and the class list of a WebDataset shard set.

The shard set's sample counts come from ``shards.json`` beside the shards (the WebDataset
``wids`` index format, ``{"__kind__": "wids-shard-index-v1", "shardlist": [{"url", "nsamples"}],
...}``, written by ``vitflow prepare --format wds``); without it one scan of the shards counts
them (logged; a remote set is scanned once per process: the run's plan and the run share it).
Class names come from ``data.classes``, else ``classes.txt`` (one name a line) or ``meta.json``
(``{"classes": [...]}``) beside the shards, else the index, else the scan.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from vitflow.data.remote.fs import is_remote, open_stream
from vitflow.data.sources.base import DataError
from vitflow.data.wds.shards import INDEX_KIND, INDEX_NAME, beside, iter_samples, parse_label, read_small

log = logging.getLogger(__name__)
_SCANS: dict[tuple[str, ...], tuple[np.ndarray, set]] = {}  # remote shard sets scanned in this process


def write_index(folder: str, counts: dict[str, int], classes: list[str], sizes: dict[str, int] | None = None,
                name: str | None = None) -> None:
    """Write ``shards.json`` (wids index format; URLs relative to ``folder``) and ``classes.txt``."""
    shardlist = [{"url": k, "nsamples": n, **({"filesize": sizes[k]} if sizes else {})} for k, n in counts.items()]
    index = {"__kind__": INDEX_KIND, "wids_version": 1, "name": name or os.path.basename(folder.rstrip("/")),
             "shardlist": shardlist, "classes": classes}
    with open(os.path.join(folder, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=1)
    with open(os.path.join(folder, "classes.txt"), "w") as f:
        f.write("".join(c + "\n" for c in classes))


def read_index(url: str) -> tuple[dict[str, int], list[str] | None]:
    """``({shard basename: samples}, classes or None)`` from the ``shards.json`` beside ``url``
    (empty when there is none).

    Raises:
        DataError: an index that is not valid JSON of the wids format (names the file).
    """
    where = beside(url, INDEX_NAME)
    data = read_small(where)
    if data is None:
        return {}, None
    try:
        index = json.loads(data)
        counts = {os.path.basename(s["url"]): int(s["nsamples"]) for s in index["shardlist"]}
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where}: not a shard index ({{\"shardlist\": [{{\"url\", \"nsamples\"}}]}}): {e}") from None
    return counts, index.get("classes")


def read_classes(url: str, classes_file: str | None) -> list[str] | None:
    """The class names from ``data.classes``, else ``classes.txt`` or ``meta.json`` beside ``url``."""
    if classes_file:
        data = read_small(os.path.expanduser(classes_file))
        if data is None:
            raise DataError(f"data.classes: {classes_file} does not exist")
        return [line.strip() for line in data.decode().splitlines() if line.strip()]
    data = read_small(beside(url, "classes.txt"))
    if data is not None:
        return [line.strip() for line in data.decode().splitlines() if line.strip()]
    data = read_small(beside(url, "meta.json"))
    if data is not None:
        try:
            return list(json.loads(data)["classes"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def scan_counts(urls: list[str]) -> tuple[np.ndarray, set]:
    """One pass over ``urls`` (labels read, images skipped): the samples of each shard (every key
    group, complete or not, as the streaming reader counts them) and the label values seen
    (class names and indices). A set of remote shards is scanned once per process (kept; local
    shards are read again: a header walk, and a rewritten shard must be counted anew)."""
    key = tuple(urls)
    if key in _SCANS:
        return _SCANS[key]
    counts, seen = [], set()
    for url in urls:
        n = 0
        with open_stream(url) as f:
            for s in iter_samples(url, f, read_images=False):
                n += 1
                try:
                    seen.add(parse_label(s, None))
                except ValueError:
                    pass
        counts.append(n)
    if all(is_remote(u) for u in urls):
        _SCANS[key] = np.asarray(counts, dtype=np.int64), seen
    return np.asarray(counts, dtype=np.int64), seen


def classes_from_labels(seen: set, where: str) -> list[str]:
    """The class list of a shard set without one: the names seen, sorted, or ``0 .. max`` index.

    Raises:
        DataError: labels that are indices in some samples and names in others.
    """
    ints = {v for v in seen if isinstance(v, int)}
    names = sorted(v for v in seen if isinstance(v, str))
    if ints and names:
        raise DataError(f"{where}: the labels are both class indices (.cls) and class names; put classes.txt "
                        "beside the shards or set data.classes")
    return names or [str(i) for i in range(max(ints) + 1 if ints else 0)]


@dataclass
class ShardSet:
    """A split's shards: ``urls``, their sample ``counts`` (``int64 (n_shards,)``) and ``classes``."""

    urls: list[str]
    counts: np.ndarray
    classes: list[str]

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def shard_set(urls: list[str], classes_file: str | None = None, classes: list[str] | None = None) -> ShardSet:
    """The counts and class list of ``urls`` (index beside them, or one logged scan).

    Raises:
        DataError: no class list anywhere and no labels found by the scan.
    """
    counts: dict[str, int] = {}
    index_classes = None
    for first in {beside(u, ""): u for u in reversed(urls)}.values():  # one shard of each folder
        c, k = read_index(first)
        counts.update(c)
        index_classes = index_classes or k
    classes = classes or read_classes(urls[0], classes_file) or index_classes
    missing = [u for u in urls if os.path.basename(u) not in counts]
    scanned: set = set()
    if missing or classes is None:
        todo = missing if classes is not None else urls
        if tuple(todo) not in _SCANS:  # a remote set scanned before in this process is not read again
            log.info("scanning %d shard(s) for their sample counts%s (write %s with vitflow prepare --format wds to "
                     "skip this)", len(todo), "" if classes is not None else " and class names", INDEX_NAME)
        n, scanned = scan_counts(todo)
        counts.update({os.path.basename(u): int(k) for u, k in zip(todo, n)})
    if classes is None and (classes := classes_from_labels(scanned, urls[0])):
        log.info("%s: no class list beside the shards; %d classes from the scanned labels: %s (put classes.txt beside "
                 "them to name them)", urls[0], len(classes), ", ".join(classes[:5]) + (", ..." * (len(classes) > 5)))
    if not classes:
        raise DataError(f"{urls[0]}: no class list: put classes.txt beside the shards or set data.classes")
    return ShardSet(urls, np.asarray([counts[os.path.basename(u)] for u in urls], dtype=np.int64), list(classes))
