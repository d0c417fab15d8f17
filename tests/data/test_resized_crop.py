"""The batched path for photos: the RAM cache at one square size (``resize_to``), the batched
random-resized crop on the device, and the eval center crop as a slice of the gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from helpers import HYMENOPTERA_TAR, encode, make_folder, need
from vitflow.config import DataConfig
from vitflow.data import open_split
from vitflow.data.augment import batch_generator, inception_boxes, random_resized_crop_flip
from vitflow.data.cache import CenterCropSource, cache_in_memory, photo_cache_size
from vitflow.data.decode import CorruptImageError, dct_factor, reducible_size
from vitflow.data.device import DevicePipeline
from vitflow.data.encode import short_side_size
from vitflow.data.pipeline import eval_loader, is_batched, train_loader
from vitflow.data.sources.base import TensorSource
from vitflow.data.transforms import Preprocess, eval_transform, model_input
from vitflow.runtime import mix_seed

CPU = torch.device("cpu")
RATIO = (3 / 4, 4 / 3)


def _torchvision_boxes(n: int, h: int, w: int, scale, ratio) -> np.ndarray:
    """``n`` boxes ``(top, left, height, width)`` from torchvision's own RandomResizedCrop."""
    rrc = v2.RandomResizedCrop(8, scale=scale, ratio=ratio)
    stand_in = [torch.empty(()).expand(3, h, w)]
    torch.manual_seed(0)
    return np.array([[p["top"], p["left"], p["height"], p["width"]]
                     for p in (rrc.make_params(stand_in) for _ in range(n))], dtype=np.float64)


@pytest.mark.parametrize("h, w, scale", [(256, 256, (0.08, 1.0)), (200, 300, (0.08, 1.0)), (300, 120, (0.3, 1.0))])
def test_crop_boxes_fall_in_range_and_are_distributed_like_torchvision(h, w, scale):
    top, left, ch, cw = (t.double().numpy() for t in inception_boxes(40_000, h, w, scale, RATIO,
                                                                       batch_generator(CPU, 1)))
    assert (ch >= 1).all() and (cw >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + ch <= h).all() and (left + cw <= w).all()
    assert (top == np.floor(top)).all() and (cw == np.floor(cw)).all()  # whole pixels
    area, aspect = ch * cw / (h * w), cw / ch
    fallback = (top == (h - ch) // 2) & (left == (w - cw) // 2) & ((ch == h) | (cw == w))
    drawn = ~fallback
    # sides are rounded to pixels: area and aspect may leave their ranges by that rounding only
    assert (area[drawn] >= scale[0] - 2 * (ch + cw)[drawn] / (h * w)).all() and (area <= 1).all()
    assert (aspect[drawn] >= RATIO[0] * (1 - 1 / ch[drawn]) * (1 - 1 / cw[drawn])).all()
    assert (aspect[drawn] <= RATIO[1] / ((1 - 1 / ch[drawn]) * (1 - 1 / cw[drawn]))).all()
    ref = _torchvision_boxes(8_000, h, w, scale, RATIO)
    ref_area, ref_aspect = ref[:, 2] * ref[:, 3] / (h * w), ref[:, 3] / ref[:, 2]
    # the same distribution: mean, spread and deciles of area and log aspect, mean relative position
    assert abs(area.mean() - ref_area.mean()) < 0.01 and abs(area.std() - ref_area.std()) < 0.01
    assert np.abs(np.quantile(area, np.linspace(0.1, 0.9, 9)) - np.quantile(ref_area, np.linspace(0.1, 0.9, 9))
                  ).max() < 0.025
    assert abs(np.log(aspect).mean() - np.log(ref_aspect).mean()) < 0.01
    assert abs(np.log(aspect).std() - np.log(ref_aspect).std()) < 0.01
    rel_top = top / np.maximum(h - ch, 1)
    ref_rel_top = ref[:, 0] / np.maximum(h - ref[:, 2], 1)
    assert abs(rel_top.mean() - ref_rel_top.mean()) < 0.02


def test_fallback_is_torchvisions_center_crop_clamped_to_the_ratio():
    # an 8:1 strip: no candidate with aspect <= 4/3 and area >= 0.9 fits, every box falls back
    top, left, ch, cw = inception_boxes(50, 40, 320, (0.9, 1.0), RATIO, batch_generator(CPU, 0))
    ref = _torchvision_boxes(5, 40, 320, (0.9, 1.0), RATIO)
    assert (ref == ref[0]).all()
    assert (torch.stack([top, left, ch, cw], 1).numpy() == ref[0]).all()  # (0, 133, 40, 53)


@pytest.mark.parametrize("out", [48, 64, 80])
def test_whole_square_crop_is_a_plain_bilinear_resize(out):
    x = torch.randint(0, 256, (4, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    got = random_resized_crop_flip(x, out, (1.0, 1.0), (1.0, 1.0), False, batch_generator(CPU, 3))
    ref = torch.nn.functional.interpolate(x.float(), size=(out, out), mode="bilinear", align_corners=False)
    assert got.dtype == torch.uint8 and got.shape == (4, 3, out, out)
    assert (got.float() - ref).abs().max() <= 1.0  # to one grey level (rounding)
    if out == 64:
        assert torch.equal(got, x)


def test_resized_crop_is_a_function_of_the_generator_seed():
    x = torch.randint(0, 256, (16, 3, 40, 56), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    a = random_resized_crop_flip(x, 32, generator=batch_generator(CPU, 5))
    b = random_resized_crop_flip(x, 32, generator=batch_generator(CPU, 5))
    c = random_resized_crop_flip(x, 32, generator=batch_generator(CPU, 6))
    assert a.shape == (16, 3, 32, 32) and a.dtype == torch.uint8
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert random_resized_crop_flip(x[:0], 32, generator=batch_generator(CPU, 5)).shape == (0, 3, 32, 32)
    with pytest.raises(ValueError, match="bilinear or bicubic"):
        random_resized_crop_flip(x, 32, generator=batch_generator(CPU, 5), interpolation="nearest")


def test_hflip_mirrors_about_half_of_the_same_crops():
    x = torch.randint(0, 256, (400, 3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    plain = random_resized_crop_flip(x, 16, (0.2, 1.0), RATIO, False, batch_generator(CPU, 9))
    flipped = random_resized_crop_flip(x, 16, (0.2, 1.0), RATIO, True, batch_generator(CPU, 9))
    same = (flipped == plain).flatten(1).all(1)
    mirrored = (flipped == plain.flip(-1)).flatten(1).all(1)
    assert (same ^ mirrored).all()  # the flip draw comes after the crop draws: same crops, some mirrored
    assert 0.4 < mirrored.float().mean() < 0.6


def test_device_pipeline_resized_crop_is_seeded_per_batch():
    x = torch.randint(0, 256, (8, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    batch = lambda index: {"images": x, "labels": torch.arange(8), "epoch": 1, "index": index}  # noqa: E731
    pipe = DevicePipeline(CPU, (0.5,) * 3, (0.25,) * 3, seed=4, hflip=True, resized_crop=(24, (0.3, 1.0), RATIO))
    assert pipe.batched_augment
    a, y = pipe(batch(2))
    assert a.shape == (8, 3, 24, 24) and a.dtype == torch.float32 and torch.equal(y, torch.arange(8))
    assert torch.equal(a, pipe(batch(2))[0]) and not torch.equal(a, pipe(batch(3))[0])
    fresh = DevicePipeline(CPU, (0.5,) * 3, (0.25,) * 3, seed=4, hflip=True, resized_crop=(24, (0.3, 1.0), RATIO))
    assert torch.equal(a, fresh(batch(2))[0])


def test_cache_resize_to_keeps_unreadable_images_in_place(tmp_path, caplog):
    src = make_folder(tmp_path / "d", per_class=3, size=12)
    (src / "a" / "truncated.jpg").write_bytes(encode(np.zeros((8, 8, 3), np.uint8), "JPEG")[:40])
    (src / "b" / "wide.png").write_bytes(encode(np.full((10, 30, 3), 77, np.uint8)))
    files = open_split(src, "train")
    with caplog.at_level("INFO", logger="vitflow.data.cache"):
        cached = cache_in_memory(files, 100, resize_to=16, center_on=12)
    assert isinstance(cached, TensorSource) and cached.images.shape == (11, 3, 16, 16)
    assert any("at 16x16 (short side resized, center crop)" in r.getMessage() for r in caplog.records)
    bad = next(i for i in range(len(files)) if files.name(i).endswith("truncated.jpg"))
    with pytest.raises(CorruptImageError, match="truncated"):
        cached.load(bad)
    wide = next(i for i in range(len(files)) if files.name(i).endswith("wide.png"))
    assert (cached.load(wide) == 77).all()
    assert cache_in_memory(cached, 100, resize_to=8) is cached  # already in RAM: unchanged
    assert photo_cache_size(224, 0.875) == 256 and photo_cache_size(32, 1.0) == 32


@pytest.fixture(scope="module")
def hymenoptera():
    """The hymenoptera photos: ``(train files, val files, val cached at 256)``."""
    path = str(need(HYMENOPTERA_TAR))
    val = open_split(path, "val")
    return open_split(path, "train"), val, cache_in_memory(val, 10_000, 2, "val", resize_to=256, center_on=224,
                                                           exact=True)


def test_cached_photos_evaluate_as_eval_transform_of_the_files(hymenoptera):
    _, files, cached = hymenoptera
    pp = Preprocess(224, 0.875, "bicubic")
    assert isinstance(cached, TensorSource) and cached.images.shape == (len(files), 3, 256, 256)
    loader = eval_loader(cached, pp, 64, num_workers="auto")
    assert loader.num_workers == 0 and isinstance(loader.dataset.source, CenterCropSource)
    got = torch.cat([b["images"] for b in loader])
    assert got.shape == (len(files), 3, 224, 224) and got.dtype == torch.uint8
    tf = eval_transform(pp)
    for i in range(len(files)):  # cached exactly (as evaluated splits are): eval_transform of the files, bit for bit
        assert torch.equal(got[i], tf(cached.load(i)))  # the slice is eval_transform of the cached image
        assert torch.equal(got[i], tf(files.load(i))), files.name(i)
    quick = cache_in_memory(files, 10_000, 2, "val", resize_to=256, center_on=224)  # as a training split is cached
    reduced = 0
    for i in range(len(files)):
        diff = (quick.load(i).int() - cached.load(i).int()).abs()
        size = reducible_size(files.encoded(i))
        if size is None or dct_factor(size, tuple(2 * s for s in short_side_size(size[1], size[0], 256)[::-1])) == 1:
            assert diff.max() == 0, files.name(i)  # decoded in full either way
        else:  # decoded at a reduced DCT scale: resampling differences only
            reduced += 1
            assert diff.float().mean() < 1.0, files.name(i)
    assert 0 < reduced <= 5


def test_train_loader_over_cached_photos_is_batched(hymenoptera):
    train_files = hymenoptera[0]
    cached = cache_in_memory(train_files, 10_000, 2, "train", resize_to=photo_cache_size(224, 0.875), center_on=224)
    cfg = DataConfig(path=str(HYMENOPTERA_TAR), source="auto", num_workers="auto")  # auto: random_resized_crop
    assert is_batched(cached, cfg, 224) and not is_batched(train_files, cfg, 224)
    assert not is_batched(cached, DataConfig(path=str(HYMENOPTERA_TAR), train_augment="pad_crop"), 224)
    loader = train_loader(cached, cfg, 224, 32, seed=0, device=CPU, num_classes=2)
    assert loader.batched and loader.num_workers == 0 and loader.batches_per_epoch == 245 // 32
    assert "device random-resized-crop/flip" in loader.describe()
    assert loader.pipeline.resized_crop == (224, tuple(cfg.scale), RATIO)
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    loader.close()
    for b in batches:  # the gather: whole cached images; the device: uint8 crops at 224, then model input
        assert b["images"].dtype == torch.uint8 and b["images"].shape == (32, 3, 256, 256)
        x, y = loader.device_batch(b)
        assert x.shape == (32, 3, 224, 224) and x.dtype == torch.float32 and y.shape == (32,)
        g = batch_generator(CPU, mix_seed(loader.pipeline.seed, b["epoch"], b["index"], 1))
        crop = random_resized_crop_flip(b["images"], 224, cfg.scale, RATIO, True, g, cfg.interpolation)
        assert crop.dtype == torch.uint8 and crop.shape == (32, 3, 224, 224)
        assert torch.equal(x, model_input(crop, cfg.mean, cfg.std))
    resumed = train_loader(cached, cfg, 224, 32, seed=0, device=CPU, num_classes=2, start=(0, 2))
    again = next(iter(resumed))
    resumed.close()
    assert torch.equal(again["images"], batches[2]["images"])
    assert torch.equal(resumed.device_batch(again)[0], loader.device_batch(batches[2])[0])
