"""Input pipeline: packed format, batched path, streaming shuffle buffer, exact resume, Mixup /
CutMix, worker randomness and memory, bad inputs."""

import io
import json
import logging
import pickle
import re

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import encode, make_folder, tar_folder
from vitflow.cli import main
from vitflow.config import DataConfig
from vitflow.data import EpochSampler, cache_in_memory, decode_image, open_split, train_loader
from vitflow.data.augment import MixupCutmix, batch_generator, pad_crop_flip
from vitflow.data.encode import fit_max_side
from vitflow.data.loader import make_loader
from vitflow.data.pipeline import choose_workers, eval_loader, is_batched, raise_open_file_limit
from vitflow.data.prepare import prepare
from vitflow.data.sources.base import DataError
from vitflow.data.sources.packed import is_packed
from vitflow.data.stream import StreamBatches, shuffle_buffer
from vitflow.data.transforms import Preprocess, eval_transform, train_transform

CPU = torch.device("cpu")


def cfg_for(path, **kw):
    base = dict(path=str(path), source="auto", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), num_workers=0)
    base.update(kw)
    return DataConfig(**base)


def take(loader, n):
    it = iter(loader)
    out = []
    for _ in range(n):
        b = next(it)
        x, y = loader.pipeline(b)
        out.append((b["epoch"], b["index"], x, y))
    loader.close()
    return out


def _raw_batches(loader, n):
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    loader.close()
    return out


def _save(img, fmt):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _exif_rotated(img):
    exif = img.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=95)
    return buf.getvalue()


def _rss_kb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("kind", ["batched", "per_image_workers"])
def test_loader_resumes_mid_epoch_exactly(tmp_path, kind):
    src = make_folder(tmp_path / "d", per_class=10, size=8)
    source = open_split(src, "train")
    if kind == "batched":
        source = cache_in_memory(source, 10_000)
        cfg = cfg_for(src, train_augment="pad_crop", padding=2, hflip=True)
    else:
        cfg = cfg_for(src, train_augment="random_resized_crop", scale=(0.3, 1.0), num_workers=2)
    assert is_batched(source, cfg, 8) == (kind == "batched")
    full = take(train_loader(source, cfg, 8, 4, seed=3, device=CPU, num_classes=3), 14)  # 7 batches/epoch
    resumed = take(train_loader(source, cfg, 8, 4, seed=3, device=CPU, num_classes=3, start=(0, 5)), 9)
    assert [(e, i) for e, i, *_ in full[5:]] == [(e, i) for e, i, *_ in resumed]
    for (_, _, x0, y0), (_, _, x1, y1) in zip(full[5:], resumed):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # augmentation really is random: epoch 1 sees the same images differently
    assert not torch.equal(torch.cat([f[2] for f in full[:7]]).sort(0).values,
                           torch.cat([f[2] for f in full[7:]]).sort(0).values)


def test_workers_do_not_repeat_augmentation(tmp_path):
    root = tmp_path / "same"
    arr = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(8):
            (root / c / f"{i}.png").write_bytes(encode(arr))  # every image identical
    source = open_split(root, "train")
    tf = train_transform(8, "random_resized_crop", (0.2, 1.0))
    sampler = EpochSampler(len(source), 4, True, True, seed=0, epochs=1)
    batches = [b["images"] for b in make_loader(source, tf, sampler, num_workers=2)]
    assert len(batches) == 4
    flat = torch.cat(batches).view(16, -1)
    assert len({tuple(r.tolist()) for r in flat}) == 16  # 16 identical inputs, 16 different crops


def test_batched_crop_matches_per_image_reference():
    g = batch_generator(CPU, 7)
    x = torch.randint(0, 256, (6, 3, 5, 5), dtype=torch.uint8)
    out = pad_crop_flip(x, 2, True, g)
    g2 = batch_generator(CPU, 7)
    dy, dx = torch.randint(0, 5, (6,), generator=g2), torch.randint(0, 5, (6,), generator=g2)
    flip = torch.rand(6, generator=g2) < 0.5
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(6):
        ref = padded[i, :, dy[i]:dy[i] + 5, dx[i]:dx[i] + 5]
        assert torch.equal(out[i], ref.flip(-1) if flip[i] else ref)


@pytest.mark.parametrize("mixup,cutmix", [(0.8, 0.0), (0.0, 1.0)])
def test_mixup_cutmix_targets_sum_to_one_and_match_pixels(mixup, cutmix):
    b, n = 8, 10
    x = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, 16, 16).clone()  # image i == i
    y = torch.arange(b)  # distinct labels, so each row's weights are readable
    for seed in range(5):
        xm, t = MixupCutmix(n, mixup, cutmix)(x, y, np.random.default_rng(seed))
        assert t.shape == (b, n) and torch.allclose(t.sum(1), torch.ones(b))
        for i in range(b // 2):
            j = b - 1 - i  # mixed with the mirrored position
            if cutmix:
                own = (xm[i] == i).float().mean().item()  # fraction of pixels still from image i
            else:
                own = ((xm[i, 0, 0, 0] - j) / (i - j)).item()  # pixel = lam * i + (1 - lam) * j
            assert t[i, i].item() == pytest.approx(own, abs=1e-5)
            assert t[i, j].item() == pytest.approx(1 - own, abs=1e-5)


def test_stream_shuffle_buffer_once_per_epoch_and_sequential_reads(tmp_path):
    src = tar_folder(make_folder(tmp_path / "d", per_class=12, size=8), tmp_path / "d.tar")
    source = open_split(src, "train")
    items = list(shuffle_buffer(iter(range(100)), 10, np.random.default_rng(0)))
    assert sorted(items) == list(range(100)) and items != list(range(100))
    tf = eval_transform(Preprocess(8, 1.0))
    ds = StreamBatches(source, tf, 4, seed=1, buffer_size=16, epochs=2)
    for epoch in (0, 1):
        order = list(ds.epoch_order(epoch))
        assert sorted(order) == list(range(36))
    assert list(ds.epoch_order(0)) != list(ds.epoch_order(1))
    reads = []
    original = source.read
    source.read = lambda i: reads.append(int(source.spans[i, 0])) or original(i)
    batches = list(ds)
    assert len(batches) == 18 and [b["index"] for b in batches[:9]] == list(range(9))
    assert reads[:36] == sorted(reads[:36])  # each epoch read in storage order
    got = torch.cat([b["images"] for b in batches[:9]])
    want = torch.stack([tf(source.load(i)) for i in ds.epoch_order(0)])
    assert torch.equal(got, want)
    resumed = list(StreamBatches(source, tf, 4, seed=1, buffer_size=16, start=(1, 3), epochs=2))
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(resumed, batches[12:]))
    shards = [list(StreamBatches(source, tf, 4, 1, 16, rank=r, world_size=2).epoch_order(0)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 16 and not set(shards[0]) & set(shards[1])


def test_stream_loader_with_workers_keeps_batch_order(tmp_path):
    src = tar_folder(make_folder(tmp_path / "d", per_class=12, size=8), tmp_path / "d.tar")
    source = open_split(src, "train")
    cfg = cfg_for(src, access="stream", shuffle_buffer=8, num_workers=2, train_augment="none", hflip=False)
    got = take(train_loader(source, cfg, 8, 4, seed=0, device=CPU, num_classes=3), 12)
    assert [(e, i) for e, i, *_ in got] == [(0, i) for i in range(9)] + [(1, i) for i in range(3)]
    one = take(train_loader(source, cfg_for(src, access="stream", shuffle_buffer=8, num_workers=0,
                                            train_augment="none", hflip=False), 8, 4, 0, CPU, 3), 12)
    assert all(torch.equal(a[2], b[2]) for a, b in zip(got, one))


def test_packed_raw_and_jpeg_read_back(tmp_path):
    src = make_folder(tmp_path / "d", per_class=5, size=8, split="train")
    make_folder(tmp_path / "d", per_class=2, size=8, split="test", seed=3)
    meta = prepare(src, tmp_path / "raw", fmt="auto", workers=2)
    assert meta["splits"]["train"]["kind"] == "raw" and is_packed(tmp_path / "raw")
    folder, packed = open_split(src, "train"), open_split(tmp_path / "raw", "train")
    assert packed.classes == folder.classes and list(packed.labels) == list(folder.labels)
    for i in range(len(folder)):
        assert torch.equal(packed.load(i), folder.load(i))
    assert torch.equal(packed.load_batch(np.array([3, 1])), torch.stack([folder.load(3), folder.load(1)]))
    assert len(open_split(tmp_path / "raw", "test")) == 6
    big = make_folder(tmp_path / "big", per_class=2, size=40, split="train")
    prepare(big, tmp_path / "jpg", fmt="jpeg", max_side=20, quality=85)
    pj, fb = open_split(tmp_path / "jpg", "train"), open_split(big, "train")
    for i in range(len(fb)):
        small = fit_max_side(fb.load(i), 20)
        assert small.shape == (3, 20, 20)
        buf = io.BytesIO()
        Image.fromarray(small.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=85)
        assert torch.equal(pj.load(i), decode_image(buf.getvalue()))  # exactly the re-encoded image


def test_prepare_refuses_overwrite_and_reads_cifar_batches(tmp_path):
    src = make_folder(tmp_path / "d", per_class=2, size=8)
    prepare(src, tmp_path / "p")
    with pytest.raises(DataError, match="--force"):
        prepare(src, tmp_path / "p")
    prepare(src, tmp_path / "p", force=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(DataError, match="not a vitflow packed dataset"):
        prepare(src, tmp_path / "other", force=True)
    assert not (tmp_path / "p.partial").exists()
    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 3)]:
        data = {b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        (cifar / name).write_bytes(pickle.dumps(data))
    (cifar / "batches.meta").write_bytes(pickle.dumps({b"label_names": [f"c{i}".encode() for i in range(10)]}))
    assert main(["prepare", str(cifar), str(tmp_path / "cp")]) == 0
    train = open_split(tmp_path / "cp", "train")
    assert len(train) == 20 and train.classes[3] == "c3" and train.fixed_size == (32, 32)
    raw = pickle.loads((cifar / "data_batch_1").read_bytes())
    assert torch.equal(train.load(0), torch.from_numpy(raw[b"data"][0].reshape(3, 32, 32)))
    assert len(open_split(cifar, "test")) == 3  # the batches can also be trained on directly
    run = tmp_path / "run"  # a packed test split has no image files: training writes a few for predict
    assert main(["train", "data.source=auto", f"data.path={tmp_path / 'cp'}", "data.test_split=test",
                 "model.img_size=8", "train.total_steps=2", "train.batch_size=4", f"train.run_dir={run}"]) == 0
    samples = sorted((run / "samples").glob("*.png"))
    first_label = int(open_split(tmp_path / "cp", "test").labels[0])
    assert len(samples) == 3 and samples[0].name == f"00_c{first_label}.png"


def test_prepare_skips_and_counts_unreadable_images(tmp_path):
    src = make_folder(tmp_path / "d", per_class=3, size=8)
    (src / "a" / "truncated.jpg").write_bytes(encode(np.zeros((8, 8, 3), np.uint8), "JPEG")[:40])
    (src / "b" / "empty.jpg").write_bytes(b"")
    assert main(["prepare", str(src), str(tmp_path / "p")]) == 0
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())["splits"]["train"]
    assert (meta["count"], meta["skipped"]) == (9, 2)
    packed = open_split(tmp_path / "p", "train")
    assert np.bincount(np.asarray(packed.labels)).tolist() == [3, 3, 3]
    assert not any("truncated" in packed.name(i) or "empty" in packed.name(i) for i in range(len(packed)))


@pytest.mark.parametrize("kind", ["batched", "resized_crop", "per_image", "mixed_sizes"])
def test_ram_cache_skips_reports_and_counts_unreadable_images_every_epoch(tmp_path, caplog, kind):
    """A bad image in a RAM-cached split is skipped, named once and counted in every epoch, exactly
    as when the files are read (same length, order, labels and per-epoch counts)."""
    from vitflow.data import SkipReport
    from vitflow.data.cache import ListSource
    from vitflow.data.sources.base import TensorSource

    src = make_folder(tmp_path / "d", per_class=6, size=8)
    (src / "a" / "truncated.jpg").write_bytes(encode(np.zeros((8, 8, 3), np.uint8), "JPEG")[:40])
    (src / "b" / "empty.jpg").write_bytes(b"")
    extra = np.full((12 if kind == "mixed_sizes" else 8,) * 2 + (3,), 90, np.uint8)
    (src / "c" / "extra.png").write_bytes(encode(extra))  # 21 images: 3 batches of 7, no tail
    files = open_split(src, "train")
    cached = cache_in_memory(files, 100)
    assert isinstance(cached, ListSource if kind == "mixed_sizes" else TensorSource)
    assert len(cached) == len(files) == 21 and list(cached.labels) == list(files.labels)
    # resized_crop: batched, the device crops; per_image: color jitter exists only per image
    cfg = cfg_for(src, train_augment="pad_crop" if kind == "batched" else "random_resized_crop", padding=1,
                  color_jitter=0.1 if kind == "per_image" else 0.0)
    assert is_batched(cached, cfg, 8) == (kind in ("batched", "resized_crop"))

    def epochs(source):
        skips, labels = SkipReport(), []
        for b in _raw_batches(train_loader(source, cfg, 8, 7, seed=0, device=CPU, num_classes=3), 6):
            skips.add(b["epoch"], b["bad"])
            labels.append(b["labels"].tolist())
            assert len(b["images"]) == len(b["labels"]) == 7 - len(b["bad"])
        return skips, labels

    with caplog.at_level("WARNING", logger="vitflow.data.loader"):
        cached_skips, cached_labels = epochs(cached)
    assert cached_skips.per_epoch == {0: 2, 1: 2} and cached_skips.total == 4
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2  # once per file, not once per epoch
    for name, why in (("truncated.jpg", "truncated"), ("empty.jpg", "0 bytes")):
        line = next(m for m in warned if name in m)
        assert str(src / ("a" if name == "truncated.jpg" else "b") / name) in line and why in line
        assert line.count("cannot decode image") <= 1  # the reason does not repeat the path
    file_skips, file_labels = epochs(files)
    assert file_skips.per_epoch == cached_skips.per_epoch and file_labels == cached_labels


def test_bad_inputs_convert_skip_or_error(tmp_path, monkeypatch):
    root = tmp_path / "bad"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    rgb = np.random.default_rng(1).integers(0, 255, (12, 10, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    good = {
        "gray.png": encode(rgb[..., 0]), "cmyk.jpg": _save(img.convert("CMYK"), "JPEG"),
        "rgba.png": _save(img.convert("RGBA"), "PNG"), "palette.png": _save(img.convert("P"), "PNG"),
        "16bit.png": _save(Image.fromarray((rgb[..., 0].astype(np.uint16) * 257)), "PNG"),
        "png_named.jpg": encode(rgb), "rotated.jpg": _exif_rotated(img),
    }
    for name, data in good.items():
        (root / "a" / name).write_bytes(data)
    jpeg = _save(img, "JPEG")
    bad = {"truncated.jpg": jpeg[: len(jpeg) // 2], "zero.jpg": b"", "text.png": b"this is not an image",
           "bomb.png": encode(np.zeros((64, 64, 3), np.uint8))}
    for name, data in bad.items():
        (root / "b" / name).write_bytes(data)
    (root / "b" / "fine.png").write_bytes(encode(rgb))
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.png").write_bytes(encode(rgb))
    (root / "a" / ".DS_Store").write_bytes(b"\0\0")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 - 1)  # makes bomb.png "too large"
    source = open_split(root, "train")
    assert source.classes == ["a", "b"] and len(source) == 12
    sampler = EpochSampler(len(source), 12, False, False, epochs=1)
    batch = next(iter(make_loader(source, eval_transform(Preprocess(8, 1.0)), sampler, num_workers=0)))
    assert batch["images"].shape == (8, 3, 8, 8)
    bad_names = sorted(n.rsplit("/", 1)[-1] for n, _ in batch["bad"])
    assert bad_names == sorted(bad)
    reasons = {n.rsplit("/", 1)[-1]: r for n, r in batch["bad"]}
    assert "decompression-bomb" in reasons["bomb.png"] and "0 bytes" in reasons["zero.jpg"]
    for name in good:
        t = decode_image(good[name], name)
        assert t.dtype == torch.uint8 and t.shape[0] == 3
    assert decode_image(good["rotated.jpg"]).shape[1:] == (10, 12)  # EXIF orientation 6 swaps H and W
    assert decode_image(good["16bit.png"])[0].tolist() == torch.from_numpy(rgb[..., 0]).tolist()


def test_exif_orientation_same_in_train_eval_and_predict(tmp_path):
    from vitflow.infer import Predictor, collect_images

    rgb = np.zeros((16, 16, 3), np.uint8)  # square: train's resize and eval's resize+crop agree
    rgb[:, :8] = 255  # left half white; EXIF orientation 6 puts it on top
    root = tmp_path / "ds"
    for c in ("x", "y"):
        (root / c).mkdir(parents=True)
        (root / c / "r.jpg").write_bytes(_exif_rotated(Image.fromarray(rgb)))
    source = open_split(root, "train")
    pp = Preprocess(8, 1.0, mean=(0.5,) * 3, std=(0.5,) * 3)
    train_img = train_transform(8, "none", hflip=False)(source.load(0))
    eval_batch = next(iter(eval_loader(source, pp, 2)))["images"][0]
    pred = Predictor(torch.nn.Identity(), ["x", "y"], pp, device="cpu")
    ref = collect_images([root / "x" / "r.jpg"])[0]
    pred_img = pred.transform(decode_image(ref.read(), ref.name))
    assert torch.equal(train_img, eval_batch) and torch.equal(eval_batch, pred_img)
    assert eval_batch[:, :4].float().mean() > 200 and eval_batch[:, 4:].float().mean() < 60  # white on top


def test_worker_memory_does_not_grow(tmp_path):
    src = make_folder(tmp_path / "d", classes=[f"c{i}" for i in range(8)], per_class=60, size=16)
    source = open_split(src, "train")
    sampler = EpochSampler(len(source), 8, True, True, seed=0, epochs=1)
    loader = make_loader(source, train_transform(16, "pad_crop"), sampler, num_workers=2)
    it = iter(loader)
    rss = []
    for k in range(len(sampler.order(0)) // 8):
        next(it)
        if k in (5, 55):
            rss.append([_rss_kb(w.pid) for w in it._workers])
    growth = max(b - a for a, b in zip(*rss))
    assert growth < 8 * 1024, f"worker RSS grew by {growth} kB over the epoch"


def test_auto_workers_and_open_file_limit(tmp_path):
    import resource

    src = make_folder(tmp_path / "d", per_class=4, size=8)
    source = cache_in_memory(open_split(src, "train"), 100)
    cfg = cfg_for(src, num_workers="auto", train_augment="pad_crop")
    assert is_batched(source, cfg, 8) and choose_workers(cfg, source, None, True) == 0
    assert raise_open_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def test_bench_data_json_line(tmp_path, capsys):
    src = make_folder(tmp_path / "d", per_class=16, size=32)
    assert main(["bench", "data", "--data", str(src), "--image-size", "32", "--repeats", "1", "--passes", "1",
                 "--workers", "1", "--batch-size", "8", "--json"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.strip().splitlines()  # --json: the JSON line alone on stdout, the table on stderr
    r = json.loads(line)
    assert set(r) == {"decode_limit_ips", "baseline_ips", "vitflow_ips", "packed_ips"}
    assert all(v > 0 for v in r.values())
    assert "x baseline" in captured.err


def test_bench_data_packs_images_of_several_sizes_as_jpeg_at_a_small_size(tmp_path, capsys):
    """At <= 64 px the packed path packs raw pixels, which needs one image size: a folder of two
    sizes (as photos are) is packed as JPEG instead of failing."""
    src = make_folder(tmp_path / "d", ["a", "b"], per_class=8, size=40)
    make_folder(tmp_path / "d", ["c"], per_class=8, size=48, seed=1)
    assert main(["bench", "data", "--data", str(src), "--image-size", "32", "--repeats", "1", "--passes", "1",
                 "--workers", "1", "--batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["packed_ips"] > 0


def test_bench_data_leaves_out_a_truncated_shards_cut_sample_with_one_warning(tmp_path, capsys, caplog):
    import tarfile

    src = make_folder(tmp_path / "d", per_class=8, size=32)  # 24 images, 3 classes
    assert main(["prepare", str(src), str(tmp_path / "wds"), "--format", "wds", "--shard-size", "8"]) == 0
    shard = tmp_path / "wds" / "train-000001.tar"
    with tarfile.open(shard) as tf:
        third = [m for m in tf.getmembers() if m.name.endswith(".png")][2]
    shard.write_bytes(shard.read_bytes()[:third.offset_data + third.size // 2])  # cut inside its third image
    pattern = f"{tmp_path}/wds/train-{{000000..000002}}.tar"
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        assert main(["bench", "data", "--data", pattern, "--image-size", "32", "--repeats", "1", "--passes", "1",
                     "--workers", "1", "--batch-size", "8", "--json"]) == 0
    assert all(v > 0 for v in json.loads(capsys.readouterr().out.strip().splitlines()[-1]).values())
    left_out = [r.getMessage() for r in caplog.records if "left out of the benchmark" in r.getMessage()]
    # the cut one and the 5 the index promised after it
    assert len(left_out) == 1 and left_out[0].startswith(f"6 unreadable image(s) left out of the benchmark (first: "
                                                         f"{shard}:")


@pytest.mark.slow
def test_bench_data_compares_other_copies_of_the_data_in_the_same_repeats(tmp_path, capsys):
    """--compare: the same images as a tar and as WebDataset shards, timed by vitflow's loader in each
    repeat beside --data's, reported with the median of the per-repeat ratios."""
    src = make_folder(tmp_path / "d", per_class=8, size=32)  # 24 images, 3 classes
    tar_folder(src, tmp_path / "d.tar")
    assert main(["prepare", str(src), str(tmp_path / "wds"), "--format", "wds", "--shard-size", "8"]) == 0
    shards = f"{tmp_path}/wds/train-{{000000..000002}}.tar"
    assert main(["bench", "data", "--data", str(tmp_path / "d.tar"), "--compare", shards, "--compare", str(src),
                 "--image-size", "32", "--repeats", "2", "--passes", "1", "--workers", "0", "--batch-size", "8",
                 "--json"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out.strip().splitlines()[-1])
    assert set(r["compare"]) == {shards, str(src)}
    for path, c in r["compare"].items():
        ratios = re.search(rf"^{re.escape(path)}: \d+ img/s, ([\d.]+)x {re.escape(str(tmp_path / 'd.tar'))} \(median "
                           rf"of the repeats' own ratios: ([\d.]+), ([\d.]+)\)$", captured.err, re.M)
        assert ratios, captured.err
        assert float(ratios[1]) == pytest.approx(c["ratio"], abs=1e-3) == (float(ratios[2]) + float(ratios[3])) / 2
        assert c["ips"] > 0
    small = make_folder(tmp_path / "small", ["x"], per_class=3, size=32)  # refused before anything is timed
    assert main(["bench", "data", "--data", str(src), "--compare", str(small), "--image-size", "32", "--batch-size",
                 "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: --compare {small} has 3 images, fewer than "
                                                                "one batch of 8: give --batch-size 1 or less")


def test_random_resized_crop_matches_torchvision():
    from torchvision.transforms import InterpolationMode, v2

    from vitflow.data.transforms import RandomHorizontalFlip, RandomResizedCrop

    for shape in ((3, 120, 150), (3, 600, 500)):  # crops enlarged / mostly shrunk
        chw = torch.randint(0, 256, shape, dtype=torch.uint8)
        hwc_view = chw.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # the layout the JPEG decoder returns
        for img in (chw, hwc_view, chw.float()):
            for interp in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
                for seed in range(20):
                    torch.manual_seed(seed)
                    ref = v2.RandomHorizontalFlip()(v2.RandomResizedCrop(64, interpolation=interp, antialias=True)(img))
                    torch.manual_seed(seed)
                    got = RandomHorizontalFlip()(RandomResizedCrop(64, interpolation=interp)(img))
                    assert got.shape == ref.shape == (3, 64, 64) and torch.equal(got, ref)


def test_reduced_dct_decode_keeps_the_crop_and_its_pixels():
    """A leading RandomResizedCrop seeing the JPEG bytes decodes a large photo at 1/2..1/8 size
    when the crop allows: same draws (same crop region, same flip) as decode-then-crop, pixels
    equal up to resampling, and the full-size path when the crop needs every pixel."""
    from vitflow.data.decode import dct_factor, jpeg_header

    yy, xx = np.mgrid[0:960, 0:1280]
    smooth = np.stack([xx * 255 // 1280, yy * 255 // 960, (xx + yy) * 255 // 2240], -1).astype(np.uint8)
    data = _save(Image.fromarray(smooth), "JPEG")
    hdr = jpeg_header(data)
    assert (hdr.width, hdr.height, hdr.components, hdr.orientation) == (1280, 960, 3, 0)
    assert jpeg_header(_exif_rotated(Image.fromarray(smooth[:40, :60]))).orientation == 6
    assert [dct_factor((1280, 960), m) for m in (None, (1280, 960), (640, 480), (300, 200), (100, 100))] == [1, 1, 2, 4, 8]
    assert decode_image(data, min_size=(300, 200)).shape == (3, 240, 320)

    tf = train_transform(64, "random_resized_crop", interpolation="bilinear")
    diffs = []
    for seed in range(20):
        torch.manual_seed(seed)
        ref, after_ref = tf(decode_image(data)), torch.rand(1)
        torch.manual_seed(seed)
        got, after_got = tf.from_encoded(data, "big.jpg"), torch.rand(1)
        assert got.shape == ref.shape == (3, 64, 64) and torch.equal(after_got, after_ref)  # same draws
        diffs.append((got.float() - ref.float()).abs().mean().item())
    assert max(diffs) < 3.0  # a smooth gradient: any crop or flip mismatch would be tens of levels off
    torch.manual_seed(0)
    small = _save(Image.fromarray(smooth[:64, :64]), "JPEG")  # the crop needs full size: decode unchanged
    ref = tf(decode_image(small))
    torch.manual_seed(0)
    assert torch.equal(tf.from_encoded(small), ref)


def test_device_pipeline_host_threads_give_the_same_batch_and_restore_the_setting():
    from vitflow.data.device import DevicePipeline

    batch = {"images": torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8), "labels": torch.arange(4),
             "epoch": 1, "index": 2}
    before = torch.get_num_threads()
    ref, y_ref = DevicePipeline(torch.device("cpu"), (0.5,) * 3, (0.25,) * 3, crop_padding=2, hflip=True)(batch)
    got, y = DevicePipeline(torch.device("cpu"), (0.5,) * 3, (0.25,) * 3, crop_padding=2, hflip=True,
                            host_threads=1)(batch)
    assert torch.equal(got, ref) and torch.equal(y, y_ref) and torch.get_num_threads() == before
    assert ref.min().item() == pytest.approx(-2.0) and ref.max().item() > 1.9  # ((0 or 255) / 255 - 0.5) / 0.25; padding is 0


def test_bench_data_names_its_own_option_for_a_small_folder(tmp_path, capsys):
    from vitflow.cli import main

    data = make_folder(tmp_path / "few", per_class=3)
    assert main(["bench", "data", "--data", str(data), "--image-size", "8", "--batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert "has 9 images, fewer than one batch of 64: give --batch-size 4 or less" in err
    assert "train.batch_size" not in err
