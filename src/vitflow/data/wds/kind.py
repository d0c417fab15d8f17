"""WebDataset shards as a source kind (``data.source=wds``): detection, split names and the
random-access view of a split come from :mod:`.layout`; the training split is streamed
(:class:`ShardStream`, read by :mod:`.stream`)."""

from __future__ import annotations

import numpy as np
import torch

from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.kind import SourceKind
from vitflow.data.sources.splits import parse_split
from vitflow.data.wds.index import ShardSet, shard_set
from vitflow.data.wds.layout import is_shard_pattern, is_wds, open_wds_split, split_urls, wds_split_names
from vitflow.data.wds.shards import first_image_sizes


class ShardStream(ImageSource):
    """The training split of a shard set, read only by streaming
    (:class:`~vitflow.data.wds.stream.ShardBatches`).

    ``labels`` are ``-1`` (unknown until read); ``len`` is the samples the index counts.
    """

    streamed = True

    def __init__(self, shards: ShardSet):
        self.shards, self.classes = shards, shards.classes
        self.labels = np.full(shards.total, -1, dtype=np.int64)

    def name(self, i: int) -> str:
        return f"{self.shards.urls[0]}...[{i}]"

    def load(self, i: int) -> torch.Tensor:
        raise DataError("training shards are read by streaming, not by index")

    def subset(self, idx: np.ndarray) -> "ImageSource":
        raise DataError("training shards cannot be sliced; give the split as its own shards")

    def sample_sizes(self, n: int) -> list[tuple[int, int]]:
        """Sizes from the first shard's first ``n`` images (not the whole split, which a remote
        shard set would download). Raises RemoteError."""
        return first_image_sizes(self.shards.urls[0], n)


def open_shard_stream(path: str, split: str, classes_file: str | None = None) -> ShardStream:
    """The training split ``split`` (a name or a shard pattern) of the shard set ``path``.

    Raises:
        DataError: a sliced split expression (``train[:90%]``: make the held-out shards their own
            split), or see :func:`~vitflow.data.wds.layout.split_urls`.
    """
    if not is_shard_pattern(split):
        sp = parse_split(split)
        if sp.sliced:
            raise DataError(f"data.train_split={split!r}: training shards are streamed and cannot be sliced; write "
                            "the held-out part as shards of its own (a val split)")
        split = sp.name
    return ShardStream(shard_set(split_urls(path, split, "data.train_split"), classes_file))


KIND = SourceKind("wds", "WebDataset shards: a pattern train-{000000..000127}.tar, a :: list, or a folder of .tar "
                  "shards", lambda where, cfg: wds_split_names(str(where)),
                  lambda where, split, classes, cfg: open_wds_split(str(where), split, classes, cfg.classes),
                  detect=lambda where: is_wds(str(where)), spec=True, stream_access=True,
                  stream=lambda where, split, cfg: open_shard_stream(str(where), split, cfg.classes))
