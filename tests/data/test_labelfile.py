"""Label files (CSV / TSV / JSONL): the same images as a folder give the same source; splits from a
column or from one file per split; every bad row named with its line and left out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from helpers import cifar_subset, rows_of, write_csv
from vitflow.config import DataConfig
from vitflow.data import DataError, open_split
from vitflow.data.sources.dispatch import resolve_eval_splits, split_names


@pytest.fixture(scope="module")
def cifar_folder(tmp_path_factory) -> Path:
    return cifar_subset(tmp_path_factory.mktemp("cifar") / "imgs")


def same_source(a, b) -> None:
    assert a.classes == b.classes and len(a) == len(b)
    assert np.array_equal(a.labels, b.labels)
    assert all(a.encoded(i) == b.encoded(i) for i in range(len(a)))


@pytest.mark.parametrize("form", ["csv", "tsv", "jsonl", "per-split files"])
def test_label_file_equals_the_folder(cifar_folder: Path, form: str):
    rows = rows_of(cifar_folder)
    folder = cifar_folder
    if form == "csv":
        path = write_csv(folder / "labels.csv", rows)
    elif form == "tsv":
        path = write_csv(folder / "labels.tsv", rows, "\t")
    elif form == "jsonl":
        path = folder / "labels.jsonl"
        path.write_text("".join(json.dumps({"image": r["path"], "class": r["label"], "split": r["split"]}) + "\n"
                                for r in rows))
    else:
        for split in ("train", "test"):
            write_csv(folder / f"{split}.csv", [r for r in rows if r["split"] == split], columns=("path", "label"))
        path = folder / "train.csv"
    assert sorted(split_names(path)) == ["test", "train"]
    for split in ("train", "test", "train[:50%]"):
        same_source(open_split(folder, split), open_split(path, split))


def test_paths_relative_to_data_root_and_class_file(cifar_folder: Path, tmp_path: Path):
    rows = [r for r in rows_of(cifar_folder) if r["split"] == "train"]
    path = write_csv(tmp_path / "elsewhere.csv", rows, columns=("path", "label"))
    classes = tmp_path / "classes.txt"
    classes.write_text("\n".join(sorted({r["label"] for r in rows}) + ["zebra"]) + "\n")
    src = open_split(path, "train", cfg=DataConfig(root=str(cifar_folder), classes=str(classes)))
    assert src.classes[-1] == "zebra" and len(src) == len(rows)
    with pytest.raises(DataError, match=r"split 'val' not found in .*elsewhere.csv: it has no split column"):
        open_split(path, "val", cfg=DataConfig(root=str(cifar_folder)))


def test_val_and_test_split_names_are_recognised(cifar_folder: Path, tmp_path: Path):
    rows = rows_of(cifar_folder)
    for r in rows[:40]:
        r["split"] = "validation" if r["split"] == "train" else r["split"]
    path = write_csv(cifar_folder / "three.csv", rows)
    cfg = DataConfig(path=str(path))
    assert resolve_eval_splits(cfg) == ("validation", "test")
    assert len(open_split(path, "val")) == sum(r["split"] == "validation" for r in rows)  # val finds validation
    only_train = write_csv(cifar_folder / "only_train.csv", [r for r in rows if r["split"] == "train"])
    with pytest.raises(DataError, match=r"has no validation or test split \(splits: train\).*val_split='train\[80%:90%\]'"):
        resolve_eval_splits(DataConfig(path=str(only_train)))


# -- bad input: one warning naming the file and line, the row left out, the rest used ---------------------


def bad_file(folder: Path, edit) -> Path:
    rows = sorted(rows_of(folder), key=lambda r: (r["split"] != "train", r["path"]))  # train rows first
    edit(rows)
    return write_csv(folder / "bad.csv", rows)


def left_out(caplog, path: Path, split: str = "train", classes=None) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        n = len(open_split(path, split, classes=classes))
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1, lines
    return n, lines[0]


def test_missing_image_file(cifar_folder: Path, caplog):
    path = bad_file(cifar_folder, lambda rows: rows.__setitem__(0, {**rows[0], "path": "train/cat/nope.jpg"}))
    n, msg = left_out(caplog, path)
    assert "bad.csv line 2: no image file" in msg and "nope.jpg" in msg and "left out 1 of" in msg
    assert n == 119


def test_unknown_label_in_the_val_split(cifar_folder: Path, caplog):
    def edit(rows):
        test = [r for r in rows if r["split"] == "test"]
        test[0]["label"] = "zebra"
    path = bad_file(cifar_folder, edit)
    n, msg = left_out(caplog, path, "test", classes=open_split(path, "train").classes)  # as training opens it
    assert "bad.csv line 122: unknown label 'zebra'" in msg and n == 59


def test_empty_label_cell(cifar_folder: Path, caplog):
    path = bad_file(cifar_folder, lambda rows: rows[5].__setitem__("label", ""))
    n, msg = left_out(caplog, path)
    assert "bad.csv line 7: empty label" in msg and n == 119


def test_duplicated_path(cifar_folder: Path, caplog):
    path = bad_file(cifar_folder, lambda rows: rows.insert(3, dict(rows[2])))
    n, msg = left_out(caplog, path)
    assert "already listed on line 4" in msg and "bad.csv line 5" in msg and n == 120


def test_header_without_the_path_column(cifar_folder: Path):
    path = write_csv(cifar_folder / "nopath.csv", rows_of(cifar_folder), columns=("label", "split"))
    with pytest.raises(DataError) as e:
        open_split(path, "train")
    msg = str(e.value)
    assert "nopath.csv: no image column among the columns (label, split)" in msg and "data.image_column" in msg
    assert "\n" not in msg


def test_multilabel_row_with_an_unknown_tag(cifar_folder: Path, caplog):
    rows = [r for r in rows_of(cifar_folder) if r["split"] == "train"]
    rows.sort(key=lambda r: r["path"])
    for i, r in enumerate(rows):
        r["label"] = f"{r['label']};{'big' if i % 2 else 'small'}"
    rows[1]["label"] = "cat;hovercraft"
    path = write_csv(cifar_folder / "tags.csv", rows, columns=("path", "label"))
    classes = cifar_folder / "tags.txt"
    known = sorted({t for r in rows[2:] for t in r["label"].split(";")})
    classes.write_text("\n".join(known))
    cfg = DataConfig(task="multilabel", classes=str(classes))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        src = open_split(path, "train", cfg=cfg)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "tags.csv line 3: unknown label 'hovercraft'" in msg and len(src) == len(rows) - 1
    assert src.labels.shape == (len(rows) - 1, len(known)) and src.labels.dtype == np.uint8
    assert (src.labels.sum(axis=1) == 2).all()  # a CIFAR class and a size tag per row
    with pytest.raises(DataError, match="data.task=multilabel needs labels from a label file"):
        open_split(cifar_folder, "train", cfg=cfg)


def test_prepare_packs_a_label_file_like_the_folder(cifar_folder: Path, tmp_path: Path):
    from vitflow.data.prepare import prepare

    path = write_csv(tmp_path / "labels.csv", [{**r, "path": str(cifar_folder / r["path"])} for r in rows_of(cifar_folder)])
    meta = prepare(path, tmp_path / "packed", fmt="raw")
    assert set(meta["splits"]) == {"train", "test"} and meta["splits"]["train"]["count"] == 120
    for split in ("train", "test"):
        packed, files = open_split(tmp_path / "packed", split), open_split(cifar_folder, split)
        assert packed.classes == files.classes and np.array_equal(packed.labels, files.labels)
        assert all(np.array_equal(packed.load(i), files.load(i)) for i in range(len(files)))
