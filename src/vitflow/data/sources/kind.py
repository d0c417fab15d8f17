"""The record that describes one source kind (a folder, a tar, a label file, ...): how ``auto``
recognises it, which splits it holds and how one is opened, plus the few properties the rest of
vitflow asks of a kind. Each kind's module declares its record (``KIND = SourceKind(...)``);
:mod:`vitflow.data.sources.table` lists them in detection order and
:mod:`vitflow.data.sources.dispatch` reads that table, so a new kind is one module and one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vitflow.config import DataConfig
from vitflow.data.sources.base import DataError, ImageSource

Where = Path | str | None  # a local path (expanded), a URL or a shard spec as given, or None (built-in data)


@dataclass(frozen=True)
class SourceKind:
    """One kind of data ``data.source`` can name.

    Attributes:
        name: the ``data.source`` value (``folder``, ``labels``, ...).
        about: one line for the configuration reference (what ``data.path`` holds).
        split_names: ``(where, cfg) -> [split, ...]``, the splits the data holds (``["train", "val"]``).
        open: ``(where, split, classes, cfg) -> ImageSource``: one split, by name (``val`` already
            mapped to the data's ``valid`` / ``validation``; the slice is applied by the caller), labelled
            with ``classes`` (``None``: the split's own). Raises DataError naming what is wrong.
        detect: ``(path) -> bool`` for ``data.source=auto`` (a local path that exists, or with
            ``spec`` the text as given); ``None``: only chosen by name.
        what: the phrase of ``PATH is not a WHAT`` when ``data.source=NAME`` names data that
            ``detect`` refuses (default: ``about``).
        needs_path: ``False`` for data built into vitflow (``data.path`` is not read).
        spec: ``data.path`` and the split keys are specs of this kind's own (shard patterns,
            ``::`` lists, URLs): detected before the checks that the path exists or is a URL of
            another kind, and ``open`` gets the split key as given (it slices by itself).
        remote: ``(url) -> bool``, whether a URL holds this kind; ``None``: not readable from a URL.
        remote_probes: ``remote`` makes a request (tried after the kinds that test the name only).
        table_labels: labels come from table columns (``data.image_column`` / ``data.label_column``),
            and may be multi-label (``data.task=multilabel``).
        stream_access: ``data.access=stream`` can read it in storage order.
        stream: ``(where, split, cfg) -> ImageSource``: the training split, read by streaming rather
            than by index (shards); ``None``: training opens the split as ``open`` does.
    """

    name: str
    about: str
    split_names: Callable[[Where, DataConfig], list[str]]
    open: Callable[[Where, str, list[str] | None, DataConfig], ImageSource]
    detect: Callable[[Where], bool] | None = None
    what: str = ""
    needs_path: bool = True
    spec: bool = False
    remote: Callable[[str], bool] | None = None
    remote_probes: bool = False
    table_labels: bool = False
    stream_access: bool = False
    stream: Callable[[Where, str, DataConfig], ImageSource] | None = None

    @property
    def refusal(self) -> str:
        """What ``PATH is not a ...`` says when this kind was asked for and ``detect`` refuses."""
        return self.what or self.about


def relabel(src: ImageSource, classes: list[str] | None) -> ImageSource:
    """``src`` (a source with its own class list: packed, CIFAR) after checking that it matches
    the training ``classes`` (``None``: nothing to check).

    Raises:
        DataError: the lists differ (the message shows the start of both).
    """
    if classes is not None and list(classes) != list(src.classes):
        raise DataError(f"the data's classes {src.classes[:5]}... differ from the training classes {classes[:5]}...")
    return src
