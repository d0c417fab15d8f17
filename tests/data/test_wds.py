"""WebDataset shards: patterns, `vitflow prepare --format wds`, detection and splits, the
per-epoch order over ranks x workers, exact resume of the order, and bad input."""

import hashlib
import io
import json
import logging
import shutil
import tarfile

import numpy as np
import pytest
import torch

from helpers import HYMENOPTERA_TAR, encode, make_folder, need, tar_folder
from vitflow.cli import main
from vitflow.config import ConfigError, DataConfig
from vitflow.data import CorruptImageError, DataError, check_config, open_split
from vitflow.data.remote.fs import expand_urls
from vitflow.data.sources.dispatch import source_kind, split_names
from vitflow.data.transforms import Preprocess, eval_transform, train_transform, transform_encoded
from vitflow.data.wds.layout import open_wds_split
from vitflow.data.wds.stream import ShardBatches, ShardDecode, open_shard_stream, shard_loader, stream_segments

CLASSES = ("a", "b", "c", "d")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder (train: 4 classes x 10, val: 4 x 3 images of 8 px) and its shards, 7 samples a shard."""
    root = tmp_path_factory.mktemp("wds")
    make_folder(root / "folder", CLASSES, per_class=10, size=8, split="train")
    make_folder(root / "folder", CLASSES, per_class=3, size=8, split="val", seed=1)
    assert main(["prepare", str(root / "folder"), str(root / "shards"), "--format", "wds", "--shard-size", "7"]) == 0
    return root / "folder", root / "shards"


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.numpy().tobytes()).hexdigest()


def test_expand_urls_braces_lists_globs_and_a_pattern_matching_nothing(tmp_path):
    for name in ("s-08.tar", "s-09.tar", "s-10.tar", "t-a.tar", "t-b.tar"):
        (tmp_path / name).write_bytes(b"")
    assert expand_urls(f"{tmp_path}/s-{{08..10}}.tar") == [str(tmp_path / f"s-{i:02d}.tar") for i in (8, 9, 10)]
    assert expand_urls(f"{tmp_path}/t-{{a,b}}.tar::{tmp_path}/s-0*.tar") == [
        str(tmp_path / n) for n in ("t-a.tar", "t-b.tar", "s-08.tar", "s-09.tar")]
    assert expand_urls("http://host/x-{0..2}.tar") == [f"http://host/x-{i}.tar" for i in range(3)]
    with pytest.raises(DataError, match=r"^data.path: pattern .*/u-\{0..3\}.tar matched no shard$"):
        expand_urls(f"{tmp_path}/u-{{0..3}}.tar")
    with pytest.raises(DataError, match=r"s-11.tar \(from pattern .*\) does not exist"):
        expand_urls(f"{tmp_path}/s-{{09..11}}.tar")


def test_prepare_writes_shards_index_and_classes_and_never_overwrites(shards, tmp_path):
    folder, out = shards
    index = json.loads((out / "shards.json").read_text())
    counts = {s["url"]: s["nsamples"] for s in index["shardlist"]}
    assert counts == {**{f"train-{i:06d}.tar": 7 for i in range(5)}, "train-000005.tar": 5,
                      "val-000000.tar": 7, "val-000001.tar": 5}
    assert (out / "classes.txt").read_text().split() == list(CLASSES)
    order = np.random.default_rng(0).permutation(40)  # the training split is written shuffled (seed 0)
    with tarfile.open(out / "train-000000.tar") as tf:
        names = tf.getnames()
        assert names[:4] == [f"{order[0]:08d}.png", f"{order[0]:08d}.cls", f"{order[1]:08d}.png", f"{order[1]:08d}.cls"]
        assert len({tf.extractfile(n).read() for n in names if n.endswith(".cls")}) > 1  # classes mixed in a shard
    with tarfile.open(out / "val-000000.tar") as tf:  # held-out splits keep their order
        assert tf.getnames()[:4] == ["00000000.png", "00000000.cls", "00000001.png", "00000001.cls"]
    keep = tmp_path / "busy"
    keep.mkdir()
    (keep / "mine.txt").write_text("x")
    from vitflow.data.prepare import prepare
    with pytest.raises(DataError, match="busy exists and is not empty; pass --force"):
        prepare(folder, keep, "wds", shard_size=7)
    with pytest.raises(DataError, match="busy exists and is not a folder of shards with their shards.json; refusing"):
        prepare(folder, keep, "wds", shard_size=7, force=True)
    assert [p.name for p in keep.iterdir()] == ["mine.txt"]
    again = shutil.copytree(out, tmp_path / "again")  # shards written before: --force replaces them, whole
    prepare(folder, again, "wds", shard_size=16, force=True)
    assert sorted(p.name for p in again.iterdir()) == ["classes.txt", "shards.json", "train-000000.tar",
                                                        "train-000001.tar", "train-000002.tar", "val-000000.tar"]
    with pytest.raises(DataError, match=r"^--shard-size 7 applies to --format wds only \(the format is jpeg\)$"):
        prepare(folder, tmp_path / "packed", "jpeg", shard_size=7)
    assert not (tmp_path / "packed").exists()


def test_auto_detection_and_splits(shards, tmp_path):
    folder, out = shards
    assert source_kind(out) == "wds" and split_names(out) == ["train", "val"]
    assert source_kind(f"{out}/train-{{000000..000005}}.tar") == "wds"
    assert source_kind(out / "val-000000.tar") == "wds"  # one shard: its members are key.png + key.cls
    assert source_kind(tar_folder(folder, tmp_path / "folder.tar")) == "tar"  # class folders in a tar
    assert source_kind(folder) == "folder"
    val = open_split(f"{out}/train-{{000000..000001}}.tar", "val-{000000..000001}.tar")
    assert len(val) == 12 and val.classes == list(CLASSES)


def test_eval_split_from_shards_is_the_folder_split_in_order(shards):
    folder, out = shards
    a, b = open_split(folder, "val"), open_split(out, "val")
    assert len(a) == len(b) == 12 and a.classes == b.classes
    assert np.array_equal(a.labels, b.labels)
    for i in range(len(a)):
        assert a.encoded(i) == b.encoded(i)


def _epoch_samples(out, rank, world, workers, epoch=0, batch=4):
    """(digest, label) of every image rank `rank` trains on in `epoch`, through a DataLoader."""
    src = open_shard_stream(str(out), "train")
    transform = eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1)))
    loader, per_epoch = shard_loader(src, transform, batch, 0, 16, (epoch, 0), rank, world, workers, 2)
    got, it = [], iter(loader)
    for _ in range(per_epoch):
        b = next(it)
        assert not b["bad"]
        got += [(_digest(x), int(y), b["index"]) for x, y in zip(b["images"], b["labels"])]
    return got


def test_ranks_x_workers_see_every_folder_sample_once_per_epoch(shards):
    folder, out = shards
    src = open_split(folder, "train")
    transform = eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1)))
    expected = sorted((_digest(transform_encoded(transform, src.encoded(i), "")), int(src.labels[i]))
                      for i in range(len(src)))
    epochs = []
    for epoch, workers in ((0, 2), (1, 0)):
        per_rank = [_epoch_samples(out, r, 2, workers, epoch) for r in (0, 1)]
        assert [len(p) for p in per_rank] == [20, 20]  # 40 samples = 2 ranks x 5 batches of 4: no tail
        assert sorted((d, y) for p in per_rank for d, y, _ in p) == expected
        epochs.append(per_rank)
    assert _epoch_samples(out, 1, 2, 2, 1) == epochs[1][1]  # the order does not depend on the worker count
    assert [d for d, _, _ in epochs[0][1]] != [d for d, _, _ in epochs[1][1]]  # reshuffled each epoch


def test_gzip_compressed_local_shards_stream_the_same_samples(shards, tmp_path):
    import gzip

    _, out = shards
    for f in out.iterdir():
        if f.name.startswith("train-"):
            (tmp_path / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes()))
    (tmp_path / "classes.txt").write_bytes((out / "classes.txt").read_bytes())
    plain = _epoch_samples(f"{out}/train-{{000000..000005}}.tar", 0, 1, 2, batch=8)
    assert len(plain) == 40
    assert _epoch_samples(f"{tmp_path}/train-{{000000..000005}}.tar.gz", 0, 1, 2, batch=8) == plain


def test_rank_parts_tail_and_resume_position(shards):
    _, out = shards
    src = open_shard_stream(str(out), "train")
    counts = src.shards.counts  # 7 x 5 + 5 = 40
    parts = [stream_segments(counts, 3, 2, r, 3) for r in range(3)]
    assert [sum(b - a for _, a, b in p) for p in parts] == [13, 13, 13]  # 40 // 3; one sample left out
    sampler = ShardBatches(src.shards, 3, seed=3, buffer_size=5, rank=1, world_size=3, epochs=3)
    assert sampler.batches_per_epoch == 4  # 13 // 3: the rank's tail of 1 is dropped
    full = [(b.epoch, b.index, [it[0] for it in b.items]) for b in sampler]
    resumed = ShardBatches(src.shards, 3, seed=3, buffer_size=5, start=(1, 3), rank=1, world_size=3, epochs=3)
    assert [(b.epoch, b.index, [it[0] for it in b.items]) for b in resumed] == full[7:]


def test_the_global_batches_are_the_same_on_one_process_and_on_two_ranks(shards):
    """With data.shard_streams=2, rank 0's batch b followed by rank 1's is the one-process batch b."""
    _, out = shards
    src = open_shard_stream(str(out), "train")

    def names(rank, world, batch, start=(0, 0)):
        sampler = ShardBatches(src.shards, batch, seed=5, buffer_size=6, start=start, rank=rank, world_size=world,
                               epochs=2, streams=2)
        return [[it[0] for it in b.items] for b in sampler]

    one = names(0, 1, 8)
    ranks = [names(r, 2, 4) for r in (0, 1)]
    assert len(one) == 2 * 5 and [a + b for a, b in zip(*ranks)] == one
    assert names(0, 1, 8, start=(1, 2)) == one[7:]  # a 2-rank run resumed on one process continues the order
    augment = ShardDecode(train_transform(8, "random_resized_crop", (0.3, 1.0), 0, True, "bilinear", "none", 0.0,
                                          0.0), seed=5)
    first = [next(iter(ShardBatches(src.shards, 8 // w, seed=5, buffer_size=6, rank=r, world_size=w, streams=2)))
             for w in (1, 2) for r in range(w)]
    single, r0, r1 = (augment[b]["images"] for b in first)
    assert torch.equal(single, torch.cat([r0, r1]))  # the same crops and flips of the same samples
    assert len({n for b in one[:5] for n in b}) == 40  # epoch 0: every sample once
    with pytest.raises(DataError, match="data.shard_streams=2 must be a multiple of the 4 rank"):
        ShardBatches(src.shards, 2, rank=0, world_size=4, streams=2)


def _shard(path, samples):
    with tarfile.open(path, "w") as tf:
        for name, data in samples:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _one_epoch_bad(out, pattern, batch):
    src = open_shard_stream(f"{out}/{pattern}", "train")
    sampler = ShardBatches(src.shards, batch, epochs=1)
    decode = ShardDecode(eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1))), 0)
    batches = [decode[b] for b in sampler]
    return sum(len(b["labels"]) for b in batches), [n for b in batches for n, _ in b["bad"]], [
        r for b in batches for _, r in b["bad"]]


def test_truncated_shard_keeps_its_good_samples_and_counts_the_rest(shards, tmp_path, caplog):
    _, out = shards
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in ("shards.json", "classes.txt", "train-000000.tar", "train-000001.tar"):
        (cut / f).write_bytes((out / f).read_bytes())
    with tarfile.open(cut / "train-000001.tar") as tf:
        fourth = [m for m in tf.getmembers() if m.name.endswith(".png")][3]
    data = (cut / "train-000001.tar").read_bytes()
    (cut / "train-000001.tar").write_bytes(data[:fourth.offset_data + fourth.size // 2])  # mid-member
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        good, bad, reasons = _one_epoch_bad(cut, "train-{000000..000001}.tar", 2)
    assert good == 7 + 3 and len(bad) == 4  # 14 samples: 3 of the cut shard kept, its 4 others counted
    assert [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()] == [
        f"{cut}/train-000001.tar: the shard ends after 3 whole samples of 7 (truncated?); one more cut short"]
    named = dict(zip(bad, reasons))
    assert "the shard ends inside this sample (truncated?)" in named[f"{cut}/train-000001.tar:00000010"]
    assert sorted(b.split(":")[-1] for b in bad) == ["#4", "#5", "#6", "00000010"]
    assert named[f"{cut}/train-000001.tar:#6"] == "missing: the shard ends after 3 whole samples of 7 (truncated?)"
    caplog.clear()
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        held_out = open_split(cut, "train")  # random access, as val/test splits are read: the same samples counted
    assert len(held_out) == 14 and held_out.name(10).endswith("train-000001.tar:00000010")
    assert [held_out.name(i).rsplit(":", 1)[1] for i in (11, 12, 13)] == ["#4", "#5", "#6"]
    assert f"{cut}/train-000001.tar: the shard ends after 3 whole samples of 7 (truncated?); one more cut short" in [
        r.getMessage() for r in caplog.records]
    held_out.load(9)
    with pytest.raises(CorruptImageError, match="train-000001.tar:00000010"):
        held_out.load(10)
    with pytest.raises(CorruptImageError, match=r"train-000001.tar:#6: missing: the shard ends after 3 whole"):
        held_out.load(13)


def test_sample_without_label_is_skipped_and_named(tmp_path, caplog):
    png = encode(np.zeros((8, 8, 3), np.uint8))
    _shard(tmp_path / "x-0.tar", [("k0.png", png), ("k0.cls", b"0"), ("k1.png", png),
                                  ("k2.png", png), ("k2.txt", b"b"), ("k3.png", png), ("k3.json", b'{"label": 1}')])
    (tmp_path / "classes.txt").write_text("a\nb\n")
    good, bad, reasons = _one_epoch_bad(tmp_path, "x-{0..0}.tar", 4)  # no index: counted by one scan
    assert good == 3 and bad == [f"{tmp_path}/x-0.tar:k1"] and reasons == ["no label file (.cls, .json or .txt)"]
    held_out = open_wds_split(str(tmp_path), "x-{0..0}.tar")  # as a val split: kept in, unreadable, so counted
    assert len(held_out) == 4 and list(held_out.labels[[0, 2, 3]]) == [0, 1, 1]
    with pytest.raises(CorruptImageError, match=r"x-0.tar:k1: no label file \(.cls, .json or .txt\)"):
        held_out.load(1)
    (tmp_path / "classes.txt").unlink()  # no class list: the scan's labels (names sorted; indices 0..max)
    with pytest.raises(DataError, match="x-0.tar: the labels are both class indices .* and class names; put"):
        open_shard_stream(f"{tmp_path}/x-0.tar", "train")
    _shard(tmp_path / "y-0.tar", [("k0.png", png), ("k0.cls", b"2"), ("k1.png", png), ("k1.cls", b"0")])
    with caplog.at_level(logging.INFO, "vitflow.data"):
        assert open_shard_stream(f"{tmp_path}/y-0.tar", "train").classes == ["0", "1", "2"]
    assert f"{tmp_path}/y-0.tar: no class list beside the shards; 3 classes from the scanned labels: 0, 1, 2 (put " \
        "classes.txt" in caplog.text


def test_split_keys_may_be_shard_patterns():
    cfg = DataConfig(path="/data/wds", train_split="train-{000000..000127}.tar", val_split="val-{000..007}.tar")
    check_config(cfg)
    with pytest.raises(ConfigError, match="data.val_split"):
        check_config(DataConfig(path="/data/wds", val_split="val[:x]"))


def test_brace_pattern_matching_nothing_names_the_pattern_and_its_key(tmp_path, shards):
    from vitflow.data.pipeline import open_datasets

    pattern = f"{tmp_path}/train-{{000000..000009}}.tar"
    with pytest.raises(DataError, match=r"^data.path: pattern .*train-\{000000..000009\}.tar matched no shard$"):
        open_shard_stream(pattern, "train")
    _, out = shards  # a split given as a pattern: its own key is named
    with pytest.raises(DataError, match=r"^data.val_split='valid-\{0..3\}.tar': pattern .*/valid-\{0..3\}.tar "
                                       r"matched no shard$"):
        open_datasets(DataConfig(path=str(out), val_split="valid-{0..3}.tar", max_in_memory=0), 8)
    with pytest.raises(DataError, match=r"^data.train_split: pattern .*/tr-\{0..3\}.tar matched no shard$"):
        open_datasets(DataConfig(path=str(out), train_split="tr-{0..3}.tar", max_in_memory=0), 8)


def test_real_photos_reshard_and_read_back(tmp_path):
    """The hymenoptera photos (JPEG bytes kept as they are) through shards: the val split equals the tar's."""
    tar = need(HYMENOPTERA_TAR)
    out = tmp_path / "hym"
    assert main(["prepare", str(tar), str(out), "--format", "wds", "--shard-size", "64"]) == 0
    a, b = open_split(tar, "val"), open_split(out, "val")
    assert len(a) == len(b) == 153 and np.array_equal(a.labels, b.labels)
    assert all(a.encoded(i) == b.encoded(i) for i in range(0, 153, 10))
    assert b.load(0).shape == a.load(0).shape
