"""Hugging Face datasets (save_to_disk folders and Parquet files) as vitflow image sources."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import CIFAR_TAR, encode, make_folder, need

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from vitflow.data import DataError, open_split  # noqa: E402
from vitflow.data.sources.hf import open_hf_split  # noqa: E402
from vitflow.data.sources.hflayout import hf_split_names, is_hf_dataset  # noqa: E402


@pytest.fixture(scope="module")
def cifar():
    """The first 200 train and 100 test images of the shared CIFAR tar: split -> folder source."""
    tar = need(CIFAR_TAR)
    return {"train": open_split(tar, "train[:200]"), "test": open_split(tar, "test[:100]")}


def _dataset(src) -> "datasets.Dataset":
    """A Dataset with an Image column (the JPEG bytes, path = the tar member) and a ClassLabel."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=src.classes)})
    rows = {"image": [{"bytes": src.encoded(i), "path": src.name(i).rsplit("/", 1)[-1]} for i in range(len(src))],
            "label": src.labels.tolist()}
    return datasets.Dataset.from_dict(rows, features=features)


def _check_same(hf, src) -> None:
    assert hf.classes == src.classes
    np.testing.assert_array_equal(hf.labels, src.labels)
    assert hf.labels.dtype == np.int64
    assert all(hf.encoded(i) == src.encoded(i) for i in range(len(src)))
    assert tuple(hf.load(0).shape) == (3, 32, 32)


def test_save_to_disk_matches_the_folder(cifar, tmp_path):
    root = tmp_path / "cifar_hf"
    datasets.DatasetDict({s: _dataset(src) for s, src in cifar.items()}).save_to_disk(str(root))
    assert is_hf_dataset(root) and hf_split_names(root) == ["train", "test"]
    train = open_hf_split(root, "train")
    _check_same(train, cifar["train"])
    _check_same(open_hf_split(root, "test", classes=train.classes), cifar["test"])
    assert train.name(17).startswith(f"{root}[train][17] (") and train.name(17).endswith(".jpg)")
    sub = train.subset(np.array([5, 3]))
    assert sub.encoded(1) == cifar["train"].encoded(3) and sub.labels.tolist() == cifar["train"].labels[[5, 3]].tolist()
    with pytest.raises(DataError, match=r"split 'val' not found in .*cifar_hf: splits found: train, test"):
        open_hf_split(root, "val")


def test_single_saved_dataset_is_the_train_split(cifar, tmp_path):
    root = tmp_path / "one"
    _dataset(cifar["test"]).save_to_disk(str(root))
    assert is_hf_dataset(root) and hf_split_names(root) == ["train"]
    _check_same(open_hf_split(root, "train"), cifar["test"])


def test_parquet_files_match_the_folder(cifar, tmp_path):
    root = tmp_path / "hub"
    (root / "data").mkdir(parents=True)
    train = _dataset(cifar["train"])
    train.select(range(120)).to_parquet(str(root / "data/train-00000-of-00002.parquet"))
    train.select(range(120, 200)).to_parquet(str(root / "data/train-00001-of-00002.parquet"))
    _dataset(cifar["test"]).to_parquet(str(root / "data/test-00000-of-00001.parquet"))
    assert is_hf_dataset(root) and hf_split_names(root) == ["train", "test"]
    hf_train = open_hf_split(root, "train")
    _check_same(hf_train, cifar["train"])
    _check_same(open_hf_split(root, "test", classes=hf_train.classes), cifar["test"])
    one = root / "data/test-00000-of-00001.parquet"
    assert is_hf_dataset(one) and hf_split_names(one) == ["train"]
    _check_same(open_hf_split(one, "train"), cifar["test"])


def _write(path: Path, columns: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_split_names_from_hub_file_names(tmp_path):
    cols = {"image": [b"x"], "label": ["a"]}
    for rel in ("validation.parquet", "test-00000-of-00001.parquet", "train/0000.parquet", "train/0001.parquet"):
        _write(tmp_path / "a" / rel, cols)
    assert hf_split_names(tmp_path / "a") == ["train", "validation", "test"]
    _write(tmp_path / "b/shard_0.parquet", cols)  # nothing names a split: all of it is train
    assert hf_split_names(tmp_path / "b") == ["train"]
    _write(tmp_path / "c/extra-00000-of-00001.parquet", cols)
    assert hf_split_names(tmp_path / "c") == ["extra"]
    assert len(open_hf_split(tmp_path / "a", "train")) == 2
    assert len(open_hf_split(tmp_path / "a", "val", classes=["a"])) == 1  # val finds validation


def test_not_hf_datasets(tmp_path):
    assert not is_hf_dataset(make_folder(tmp_path / "imgs"))
    packed = tmp_path / "packed"
    _write(packed / "train.parquet", {"image": [b"x"], "label": ["a"]})
    (packed / "meta.json").write_text(json.dumps({"format": "vitflow-packed"}))
    assert not is_hf_dataset(packed)
    with_meta = make_folder(tmp_path / "imagefolder")
    _write(with_meta / "metadata.parquet", {"file_name": ["a/000.png"]})
    assert not is_hf_dataset(with_meta)


def test_no_image_column_names_file_and_columns(tmp_path):
    f = _write(tmp_path / "x.parquet", {"label": ["a"], "caption": ["hi"]})
    with pytest.raises(DataError) as e:
        open_hf_split(f, "train")
    msg = str(e.value)
    assert "\n" not in msg and str(f) in msg and "(label, caption)" in msg and "data.image_column=COLUMN" in msg
    g = _write(tmp_path / "y.parquet", {"image": [b"x"], "caption": ["hi"]})
    with pytest.raises(DataError, match=r"y\.parquet: no label column among the columns \(caption\)"):
        open_hf_split(g, "train")
    with pytest.raises(DataError, match=r"y\.parquet: no column 'img' \(data\.image_column\)"):
        open_hf_split(g, "train", image_column="img")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable Parquet file"):
        open_hf_split(bad, "train")
    empty = _write(tmp_path / "empty.parquet", {"image": pa.array([], pa.binary()), "label": pa.array([], pa.string())})
    with pytest.raises(DataError, match=r"empty\.parquet: split 'train' is empty"):
        open_hf_split(empty, "train")


def test_multilabel_columns(tmp_path, caplog):
    png = [encode(np.full((4, 4, 3), v, np.uint8)) for v in (10, 20, 30, 40)]
    f = _write(tmp_path / "ml.parquet", {"image": png, "labels": [["cat"], ["cat", "dog"], ["dog"], []]})
    with caplog.at_level(logging.WARNING):
        src = open_hf_split(f, "train", multilabel=True)
    assert src.classes == ["cat", "dog"] and src.labels.dtype == np.uint8
    assert src.labels.tolist() == [[1, 0], [1, 1], [0, 1]] and src.encoded(2) == png[2]
    assert "ml.parquet[train][3]: empty label" in caplog.text
    features = datasets.Features({"image": datasets.Image(), "tags": datasets.Sequence(datasets.ClassLabel(
        names=["x", "y", "z"]))})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in png[:2]], "tags": [[2], [0, 2]]},
                                    features=features)
    ds.to_parquet(str(tmp_path / "seq.parquet"))
    src = open_hf_split(tmp_path / "seq.parquet", "train", multilabel=True)
    assert src.classes == ["x", "y", "z"] and src.labels.tolist() == [[0, 0, 1], [1, 0, 1]]


def test_unknown_test_label_is_left_out(tmp_path, caplog):
    png = encode(np.zeros((4, 4, 3), np.uint8))
    _write(tmp_path / "d/train.parquet", {"image": [png] * 3, "label": ["b", "a", "b"]})
    _write(tmp_path / "d/test.parquet", {"image": [png] * 3, "label": ["a", "zebra", "b"]})
    train = open_hf_split(tmp_path / "d", "train")
    assert train.classes == ["a", "b"] and train.labels.tolist() == [1, 0, 1]
    with caplog.at_level(logging.WARNING):
        test = open_hf_split(tmp_path / "d", "test", classes=train.classes)
    assert test.labels.tolist() == [0, 1] and test.name(1).endswith("[test][2]")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "[test][1]: unknown label 'zebra'" in warnings[0].getMessage()
    assert "left out 1 of 3 rows" in warnings[0].getMessage()


def test_image_paths_relative_to_the_dataset(tmp_path, caplog):
    root = tmp_path / "ds"
    (root / "images").mkdir(parents=True)
    pngs = [encode(np.full((5, 6, 3), v, np.uint8)) for v in (0, 100)]
    for i, b in enumerate(pngs):
        (root / "images" / f"{i}.png").write_bytes(b)
    _write(root / "data/train.parquet", {"image": ["images/0.png", "images/missing.png", "images/1.png"],
                                         "label": [3, 1, 10]})
    assert is_hf_dataset(root) and hf_split_names(root) == ["train"]
    with caplog.at_level(logging.WARNING):
        src = open_hf_split(root, "train")
    assert src.classes == ["3", "10"] and src.labels.tolist() == [0, 1]  # integer values sort as numbers
    assert src.encoded(0) == pngs[0] and src.encoded(1) == pngs[1] and tuple(src.load(1).shape) == (3, 5, 6)
    assert src.name(1).endswith("[train][2] (images/1.png)")
    assert "[train][1]: image file not found" in caplog.text


_FORKED: dict = {}


def _read_in_child(i: int) -> bytes:
    return _FORKED["src"].encoded(i)  # the source the child inherited by fork, not a pickled copy


def test_fast_lookup_and_forked_workers(tmp_path):
    rng = np.random.default_rng(0)
    blobs = [rng.bytes(int(n)) for n in rng.integers(500, 1500, 60_000)]
    chunks = [pa.array(blobs[i:i + 7_000], pa.binary()) for i in range(0, len(blobs), 7_000)]
    pq.write_table(pa.table({"image": pa.chunked_array(chunks), "label": [str(i % 10) for i in range(60_000)]}),
                   tmp_path / "big.parquet", row_group_size=7_000)
    src = open_hf_split(tmp_path / "big.parquet", "train").subset(rng.permutation(60_000))
    idx = rng.integers(0, 60_000, 20_000)
    start = time.perf_counter()
    for i in idx:
        src.encoded(int(i))
    per_image = (time.perf_counter() - start) / len(idx)
    assert per_image < 1e-4, f"{per_image * 1e6:.0f} us per image"
    assert all(src.encoded(int(i)) == blobs[src.rows[i]] for i in idx[:2000])
    _FORKED["src"] = src
    try:
        with mp.get_context("fork").Pool(2) as pool:
            got = pool.map(_read_in_child, [int(i) for i in idx[:4]])
    finally:
        _FORKED.clear()
    assert got == [blobs[src.rows[i]] for i in idx[:4]]


def test_missing_optional_dependencies_are_named(tmp_path, monkeypatch):
    f = _write(tmp_path / "x.parquet", {"image": [b"x"], "label": ["a"]})
    datasets.Dataset.from_dict({"image": [b"x"], "label": ["a"]}).save_to_disk(str(tmp_path / "saved"))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs pip install 'vitflow\[hf\]'"):
        open_hf_split(tmp_path / "saved", "train")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pip install 'vitflow\[hf\]'"):
        open_hf_split(f, "train")
