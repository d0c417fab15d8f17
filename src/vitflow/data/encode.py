"""Decoding (and re-encoding) every image of a source with worker processes: what the RAM cache
and ``vitflow prepare`` do to a whole split."""

from __future__ import annotations

import io
import multiprocessing as mp
from typing import Iterator

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from vitflow.data.decode import CorruptImageError
from vitflow.data.sources import ImageSource
from vitflow.runtime import quiet


def _encode_one(source: ImageSource, i: int, kind: str, max_side: int | None, quality: int):
    """Worker: image ``i`` -> raw uint8 array or JPEG bytes; ``(i, payload | None, why unreadable)``."""
    try:
        img = source.load(i)
    except CorruptImageError as e:
        return i, None, e.reason
    if kind == "raw":
        return i, img.numpy(), None
    return i, encode_jpeg(fit_max_side(img, max_side), quality), None


def fit_max_side(img: torch.Tensor, max_side: int | None) -> torch.Tensor:
    """Downscale ``uint8 (3, H, W)`` (antialiased bilinear) so that ``max(H, W) <= max_side``."""
    h, w = img.shape[-2:]
    if not max_side or max(h, w) <= max_side:
        return img
    from torchvision.transforms.v2 import functional as F

    scale = max_side / max(h, w)
    return F.resize(img, [max(1, round(h * scale)), max(1, round(w * scale))], antialias=True)


def encode_jpeg(img: torch.Tensor, quality: int) -> bytes:
    """``uint8 (3, H, W)`` -> baseline JPEG bytes (Pillow / libjpeg-turbo)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


_WORKER_SOURCE: ImageSource | None = None


def _init_worker(source: ImageSource) -> None:
    global _WORKER_SOURCE
    _WORKER_SOURCE = source
    torch.set_num_threads(1)


def _work(args):
    return _encode_one(_WORKER_SOURCE, *args)


def encode_images(source: ImageSource, kind: str, max_side: int | None, quality: int, workers: int,
                  desc: str) -> Iterator[tuple[int, object, str | None]]:
    """Decode every image of ``source`` (``kind="raw"``: ``uint8 (3, H, W)`` arrays) or also
    re-encode it (``"jpeg"``: bytes at ``quality``, longer side <= ``max_side``) with ``workers``
    processes and a progress bar; yields ``(index, payload or None, why the image is unreadable
    or None)`` in index order."""
    jobs = [(i, kind, max_side, quality) for i in range(len(source))]
    bar = dict(total=len(jobs), desc=desc, unit="img", mininterval=1.0, disable=quiet())
    with logging_redirect_tqdm():  # warnings about bad images print above the bar, not into it
        if workers <= 1:
            yield from tqdm((_encode_one(source, *j) for j in jobs), **bar)
            return
        with mp.get_context("fork").Pool(workers, _init_worker, (source,)) as pool:
            yield from tqdm(pool.imap(_work, jobs, chunksize=64), **bar)
