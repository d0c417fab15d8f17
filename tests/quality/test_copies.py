"""Copies and leaks on real photos (hymenoptera): near-copies planted the way the must-show plants
them (cropped to 90%, resized, JPEG quality 60) are all found, look-alike photos are not, and the
pHash agrees bit for bit with the imagehash library's."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import HYMENOPTERA_TAR, hymenoptera_subset, need
from vitflow.config import DataConfig
from vitflow.data import open_split
from vitflow.quality.duplicates import find_copies
from vitflow.quality.inspection import copy_rows, open_splits
from vitflow.quality.phash import crop_views, phash, view_correlation
from vitflow.quality.scan import scan_split


def _copy(data: bytes, seed: int) -> bytes:
    """Cropped to 90% at a random place, resized by 0.7, JPEG quality 60."""
    rng = np.random.default_rng(seed)
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    cw, ch = int(w * 0.9), int(h * 0.9)
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = img.crop((x, y, x + cw, y + ch)).resize((int(cw * 0.7), int(ch * 0.7)), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=60)
    return buf.getvalue()


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """30 train and 20 val photos a class; 4 val photos planted in train as near-copies, one train
    photo copied byte for byte inside train."""
    root = tmp_path_factory.mktemp("planted")
    truth = []
    hymenoptera_subset(root, (("train", 30), ("val", 20)))
    for k, f in enumerate(sorted((root / "val" / "ants").iterdir())[:2] + sorted((root / "val" / "bees").iterdir())[:2]):
        dst = root / "train" / f.parent.name / f"planted_{k}.jpg"
        dst.write_bytes(_copy(f.read_bytes(), k))
        truth.append((f"train/{f.parent.name}/{dst.name}", f"val/{f.parent.name}/{f.name}"))
    first = sorted((root / "train" / "bees").iterdir())[0]
    (root / "train" / "bees" / "exact_copy.jpg").write_bytes(first.read_bytes())
    return root, truth, f"train/bees/{first.name}"


def test_phash_is_imagehash_phash_bit_for_bit():
    imagehash = pytest.importorskip("imagehash")
    g = np.random.default_rng(0).integers(0, 256, (6, 32, 32)).astype(np.uint8)
    ours = phash(torch.from_numpy(g).float())
    for i in range(len(g)):
        theirs = imagehash.phash(Image.fromarray(g[i], "L")).hash.flatten()
        assert (np.unpackbits(ours[i:i + 1].view(np.uint8), bitorder="little").astype(bool) == theirs).all()


def test_a_cropped_recompressed_copy_correlates_and_other_photos_do_not():
    src = open_split(need(HYMENOPTERA_TAR), "train[:12]")
    def views(data):
        from vitflow.data.decode import decode_image
        from vitflow.quality.scan import GRAY
        img = decode_image(data).float()
        luma = (torch.nn.functional.interpolate(img[None], size=(64, 64), mode="bilinear", antialias=True)[0]
                * GRAY).sum(0)
        return crop_views(luma)[1].round().to(torch.uint8).numpy()
    orig = [views(src.encoded(i)) for i in range(len(src))]
    copies = [views(_copy(src.encoded(i), i)) for i in range(len(src))]
    same = view_correlation(np.stack(orig), np.stack(copies))
    other = view_correlation(np.stack(orig), np.stack(copies[1:] + copies[:1]))
    assert same.min() >= 0.92, same
    assert other.max() < 0.9, other


def test_planted_copies_are_leaks_found_all_and_only(planted):
    root, truth, copied = planted
    scans = [scan_split(src, name) for name, src in open_splits(DataConfig(path=str(root)))]
    rows = copy_rows(scans)
    leaks = {(r["key"], r["other_key"]) for r in rows if r["finding"] == "leak"}
    assert leaks == set(truth)  # the training-side copy is the row: dropping it keeps val whole
    exact = [r for r in rows if r["finding"] == "exact_duplicate"]
    assert [(r["key"], r["other_key"]) for r in exact] == [("train/bees/exact_copy.jpg", copied)] or \
        [(r["other_key"], r["key"]) for r in exact] == [("train/bees/exact_copy.jpg", copied)]
    assert not [r for r in rows if r["finding"] == "near_duplicate"]
    near = [p for p in find_copies(scans) if p.kind == "near"]
    assert len(near) == 4 and all(p.correlation >= 0.92 or p.phash_bits <= 6 and p.correlation >= 0.8 for p in near)


def test_the_cut_rises_where_every_image_looks_like_its_neighbours():
    """Cells on a slide correlate at 0.95 with any other cell: a copy must stand out of its data
    (1 - correlation at most a quarter of the median's), and such near-copies are for review."""
    from vitflow.quality.duplicates import HOMOGENEOUS_MEDIAN, data_cuts

    n = 200
    a, b = np.arange(n), (np.arange(n) + 1) % n
    varied = np.full(n, 0.6, np.float32)  # photos: the nearest image correlates at 0.6
    cut, close, median = data_cuts(varied, a, b, n)
    assert cut == 0.92 and close == pytest.approx(0.8) and median == pytest.approx(0.6)
    alike = np.full(n, 0.96, np.float32)
    cut, close, median = data_cuts(alike, a, b, n)
    assert cut == pytest.approx(0.99) and close == pytest.approx(0.98) and median > HOMOGENEOUS_MEDIAN
    half = np.where(np.arange(n) < n // 3, 0.99, 0.5).astype(np.float32)  # a third of the images copies: robust
    assert data_cuts(half, a, b, n)[0] == 0.92
