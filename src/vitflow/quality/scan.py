"""One pass over a split: what every image is (:class:`SplitScan`): its content hash, perceptual
hash, size, brightness and contrast, why it cannot be read, and its embedding by a model.

Images are read and decoded by threads (libjpeg-turbo and the resizes release the GIL) one chunk
ahead of the model, as :func:`vitflow.infer.predict.decoded_batches` does; memory stays at a chunk
of decoded images plus ``(N, D)`` features, whatever ``N``.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vitflow.data import model_input
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.fixes import image_key
from vitflow.data.sources.base import ImageSource
from vitflow.data.transforms import eval_transform
from vitflow.infer.features.backbone import Backbone
from vitflow.infer.features.embed import pooled_features
from vitflow.quality.phash import VIEW_SIDE, VIEWS, crop_views, phash

log = logging.getLogger(__name__)
CHUNK = 64  # images decoded ahead of the model
GRAY = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)  # ITU-R BT.601 luma
NUMERIC = ("phash", "views", "width", "height", "nbytes", "brightness", "contrast")  # the array columns beside labels


@dataclass
class SplitScan:
    """What one split holds, one row per image (in the split's order).

    ``keys``: the images' names in fix files (:func:`vitflow.data.fixes.image_key`); ``names``: their
    display paths; ``labels``: ``int64 (N,)``; ``sha1``: hex digests of the encoded bytes (``""``
    unreadable); ``width``/``height``: ``int32`` pixels;
    ``nbytes``: encoded size in bytes; ``views``: ``uint8 (N, V, 16, 16)`` luma of the whole image and of
    its 90% crops (:func:`vitflow.quality.phash.crop_views`), ``phash``: ``uint64 (N, V)`` their pHashes; ``brightness``/``contrast``: mean and standard deviation of
    the luma, 0..255; ``error``: why an image cannot be read (``""``: it can); ``features``:
    ``float32 (N, D)`` pooled embeddings (rows of unreadable images are zero) or ``None``.
    """

    split: str
    classes: list[str]
    keys: list[str]
    names: list[str]
    labels: np.ndarray
    sha1: list[str] = field(default_factory=list)
    phash: np.ndarray | None = None
    views: np.ndarray | None = None
    width: np.ndarray | None = None
    height: np.ndarray | None = None
    nbytes: np.ndarray | None = None
    brightness: np.ndarray | None = None
    contrast: np.ndarray | None = None
    error: list[str] = field(default_factory=list)
    features: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def readable(self) -> np.ndarray:
        """``bool (N,)``: the image could be read and decoded."""
        return np.array([not e for e in self.error], dtype=bool)

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-image columns as arrays (for the cache file)."""
        out = {k: getattr(self, k) for k in ("labels", *NUMERIC)}
        out.update(sha1=np.array(self.sha1), error=np.array(self.error), keys=np.array(self.keys))
        if self.features is not None:
            out["features"] = self.features
        return out


def _read(source: ImageSource, i: int, transform) -> tuple:
    """``(sha1, (w, h), nbytes, gray 32x32, luma stats, model input)`` of image ``i``, or the error text."""
    try:
        data = source.encoded(i)
        img = source.load(i) if data is None else decode_image(data, source.name(i))
    except (CorruptImageError, OSError) as e:
        return (str(e),)
    raw = data if data is not None else img.numpy().tobytes()
    h, w = img.shape[-2:]
    small = F.interpolate(img[None].float(), size=(64, 64), mode="bilinear", antialias=True, align_corners=False)[0]
    luma = (small * GRAY).sum(0)
    return (hashlib.sha1(raw).hexdigest(), (w, h), len(raw), crop_views(luma), (float(luma.mean()), float(luma.std())),
            transform(img) if transform is not None else None)


def scan_split(source: ImageSource, split: str, backbone: Backbone | None = None, batch_size: int = 64,
               workers: int = 2) -> SplitScan:
    """Every image of ``source`` read once: hashes, sizes, luma statistics and, with ``backbone``,
    pooled features (:func:`~vitflow.infer.features.embed.pooled_features`) under its evaluation
    preprocessing. An unreadable image gets its ``error`` and zero rows; it never stops the scan."""
    n = len(source)
    scan = SplitScan(split, list(source.classes), [image_key(source, i) for i in range(n)],
                     [source.name(i) for i in range(n)], np.asarray(source.labels).copy())
    scan.sha1, scan.error = [""] * n, [""] * n
    scan.phash = np.zeros((n, VIEWS), np.uint64)
    scan.views = np.zeros((n, VIEWS, VIEW_SIDE, VIEW_SIDE), np.uint8)
    scan.width, scan.height = np.zeros(n, np.int32), np.zeros(n, np.int32)
    scan.nbytes = np.zeros(n, np.int64)
    scan.brightness, scan.contrast = np.zeros(n, np.float32), np.zeros(n, np.float32)
    transform = eval_transform(backbone.preprocess) if backbone is not None else None
    model = backbone.model.eval() if backbone is not None else None
    step = max(CHUNK, batch_size)
    chunks = [range(s, min(s + step, n)) for s in range(0, n, step)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        pending = [pool.map(lambda i: _read(source, i, transform), c) for c in chunks[:1]]
        for c, idx in enumerate(chunks):
            rows = list(pending.pop(0))
            if c + 1 < len(chunks):
                pending.append(pool.map(lambda i: _read(source, i, transform), chunks[c + 1]))
            _store(scan, idx, rows, model, backbone, batch_size)
    bad = n - int(scan.readable.sum())
    if bad:
        log.warning("split %r: %d of %d image(s) cannot be read (listed as broken)", split, bad, n)
    return scan


@torch.no_grad()
def _store(scan: SplitScan, idx: range, rows: list[tuple], model, backbone: Backbone | None, batch_size: int) -> None:
    ok = [(i, r) for i, r in zip(idx, rows) if len(r) > 1]
    for i, r in zip(idx, rows):
        if len(r) == 1:
            scan.error[i] = r[0]
    if not ok:
        return
    at = np.array([i for i, _ in ok])
    for i, r in ok:
        scan.sha1[i] = r[0]
    scan.width[at] = [r[1][0] for _, r in ok]
    scan.height[at] = [r[1][1] for _, r in ok]
    scan.nbytes[at] = [r[2] for _, r in ok]
    grays = torch.stack([r[3][0] for _, r in ok])  # (B, V, 32, 32)
    scan.phash[at] = phash(grays.flatten(0, 1)).reshape(len(ok), VIEWS)
    scan.views[at] = torch.stack([r[3][1] for _, r in ok]).round().clamp(0, 255).to(torch.uint8).numpy()
    scan.brightness[at] = [r[4][0] for _, r in ok]
    scan.contrast[at] = [r[4][1] for _, r in ok]
    if model is None:
        return
    pp = backbone.preprocess
    for s in range(0, len(ok), batch_size):
        part = ok[s:s + batch_size]
        x = model_input(torch.stack([r[5] for _, r in part]), pp.mean, pp.std, torch.device("cpu"))
        f = pooled_features(model, x).numpy()
        if scan.features is None:
            scan.features = np.zeros((len(scan), f.shape[1]), np.float32)
        scan.features[at[s:s + batch_size]] = f
