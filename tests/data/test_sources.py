"""Image sources: folders and tars, split slices, hidden and non-image files, unreadable images, decoding, CIFAR read in place."""

import io
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import CIFAR_TAR, encode, make_folder, need, tar_folder
from vitflow.data import DataError, EpochSampler, decode_image, open_split
from vitflow.data.decode import CorruptImageError
from vitflow.data.loader import make_loader
from vitflow.data.sources.splits import parse_split
from vitflow.data.transforms import Preprocess, eval_transform


def _jpeg(size=16, seed=0):
    rng = np.random.default_rng(seed)
    return encode(rng.integers(0, 255, (size, size, 3), dtype=np.uint8), "JPEG", quality=90)


def _save(img, fmt):
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def test_folder_and_tar_give_the_same_items(tmp_path):
    root = make_folder(tmp_path / "ds", split="train")
    make_folder(tmp_path / "ds", split="test", per_class=3, seed=1)
    tar = tar_folder(root, tmp_path / "ds.tar")
    for split in ("train", "test"):
        a = open_split(root, split)
        b = open_split(tar, split)
        assert a.classes == b.classes == ["a", "b", "c"]
        assert list(a.labels) == list(b.labels)
        for i in range(len(a)):
            assert torch.equal(a.load(i), b.load(i))
    assert len(open_split(tar, "train")) == 24 and len(open_split(tar, "test")) == 9


def test_split_slices_are_disjoint_cover_and_stratify():
    sp = parse_split("train[:80%]")
    assert (sp.name, sp.start, sp.stop) == ("train", None, "80%")
    a, b = parse_split("train[:80%]").select(1000), parse_split("train[80%:]").select(1000)
    assert len(a) == 800 and len(b) == 200
    assert set(a).isdisjoint(b) and set(a) | set(b) == set(range(1000))
    assert list(parse_split("test[10:20]").select(100)) == list(parse_split("test").select(100)[
        np.random.default_rng(0).permutation(100)[10:20]])
    with pytest.raises(ValueError, match="not a split"):
        parse_split("train[:98")


def test_digits_split_is_stratified():
    train = open_split(None, "train[:80%]", "digits")
    test = open_split(None, "train[80%:]", "digits")
    assert len(train) + len(test) == 1797
    assert set(train.names).isdisjoint(test.names)
    counts = np.bincount(test.labels, minlength=10)
    assert counts.min() >= 20  # every class held out in about its share (~36 each)
    img = train.load(0)
    assert img.dtype == torch.uint8 and img.shape == (3, 8, 8) and img.max() > 200


def test_hidden_folders_and_non_images_never_become_classes(tmp_path, caplog):
    root = make_folder(tmp_path / "ds", per_class=2)
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "x.png").write_bytes((root / "a" / "000.png").read_bytes())
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "a" / ".hidden.png").write_bytes(b"junk")
    (root / "README.md").write_text("loose file")
    with caplog.at_level(logging.WARNING):
        src = open_split(root, "train")
    assert src.classes == ["a", "b", "c"] and len(src) == 6
    assert "1 non-image files" in caplog.text and "1 files outside class folders" in caplog.text
    for tar_src in [open_split(tar_folder(root, tmp_path / "ds.tar"), "train")]:
        assert tar_src.classes == ["a", "b", "c"] and len(tar_src) == 6


def test_ignored_files_notice_once_per_source_with_examples(tmp_path, caplog):
    root = make_folder(tmp_path / "ds", per_class=4)
    for i in range(5):
        (root / "b" / f"notes{i}.txt").write_text("not an image")
    tar = tar_folder(root, tmp_path / "ds.tar")
    with caplog.at_level(logging.WARNING, logger="vitflow.data.sources.base"):
        for path in (root, tar):
            parts = [open_split(path, s) for s in ("train[:50%]", "train[50%:]", "train", "train[:2]")]
            assert sum(len(p) for p in parts[:2]) == len(parts[2]) == 12
    # the ignored-files notices (train[:2] also lacks a class: the split's own warning)
    notes = [r.getMessage() for r in caplog.records if "has no images of" not in r.getMessage()]
    assert len(notes) == 2  # one per source (the folder, the tar), not one per slice
    folder_note, tar_note = notes
    assert "5 non-image files" in folder_note and str(root / "b" / "notes0.txt") in folder_note
    assert str(root / "b" / "notes2.txt") in folder_note and "notes3.txt" not in folder_note  # 3 examples
    assert "5 non-image files" in tar_note and f"{tar}:ds/b/notes0.txt" in tar_note


def test_empty_class_folder_is_an_error_naming_it(tmp_path):
    root = make_folder(tmp_path / "ds", per_class=2)
    (root / "zebra").mkdir()
    (root / "zebra" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=r"no images in .*zebra"):
        open_split(root, "train")


def test_missing_path_and_split_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        open_split(tmp_path / "nope", "train")
    root = make_folder(tmp_path / "ds", per_class=2)
    with pytest.raises(DataError, match=r"split 'test' not found.*train\[90%:\]"):
        open_split(root, "test")
    not_tar = tmp_path / "x.tar"
    not_tar.write_bytes(b"hello")
    with pytest.raises(DataError, match="not a tar archive"):
        open_split(not_tar, "train")
    with pytest.raises(DataError, match="not in the training classes"):
        open_split(root, "train", classes=["a", "b"])


def test_corrupt_images_are_skipped_and_reported(tmp_path):
    root = make_folder(tmp_path / "ds", per_class=4)
    data = _jpeg()
    (root / "a" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (root / "b" / "empty.jpg").write_bytes(b"")
    (root / "c" / "text.jpg").write_text("this is not a jpeg")
    src = open_split(root, "train")
    assert len(src) == 15
    with pytest.raises(CorruptImageError, match="truncated.jpg"):
        src.load(src.names.index(str(root / "a" / "truncated.jpg")))
    sampler = EpochSampler(len(src), 15, shuffle=False, drop_last=False, epochs=1)
    batch = next(iter(make_loader(src, eval_transform(Preprocess(8, 1.0)), sampler, num_workers=0)))
    assert batch["images"].shape == (12, 3, 8, 8)
    bad = sorted(name.rsplit("/", 1)[-1] for name, _ in batch["bad"])
    assert bad == ["empty.jpg", "text.jpg", "truncated.jpg"]
    reasons = dict((n.rsplit("/", 1)[-1], r) for n, r in batch["bad"])
    assert "0 bytes" in reasons["empty.jpg"]
    assert "truncated" in reasons["truncated.jpg"] and ".cpp" not in reasons["truncated.jpg"]  # no C++ source path


def test_decode_handles_modes_and_exif(tmp_path):
    rgb = np.zeros((4, 6, 3), np.uint8)
    rgb[:, :3] = 255  # left half white
    img = Image.fromarray(rgb)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 CW on display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=100)
    out = decode_image(buf.getvalue(), "rot.jpg")
    assert out.shape == (3, 6, 4)  # height and width swapped by the orientation tag
    assert out[:, :3].float().mean() > 200 and out[:, 3:].float().mean() < 50  # left half -> top half
    for mode in ("L", "P", "RGBA", "CMYK"):
        fmt = "JPEG" if mode == "CMYK" else "PNG"
        t = decode_image(encode(np.asarray(img.convert(mode)), fmt) if mode != "CMYK" else
                         _save(img.convert("CMYK"), "JPEG"), mode)
        assert t.shape == (3, 4, 6) and t.dtype == torch.uint8
    png16 = _save(Image.fromarray(np.full((3, 3), 65535, np.uint16)), "PNG")
    assert decode_image(png16, "16bit.png").min() == 255
    bmp = _save(img, "BMP")
    assert torch.equal(decode_image(bmp, "x.bmp"), torch.from_numpy(rgb).permute(2, 0, 1))


def test_cifar_tar_read_in_place():
    tar = need(CIFAR_TAR)
    train = open_split(tar, "train[:98%]")
    test = open_split(tar, "test", classes=train.classes)
    assert train.classes == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert len(train) == 49_000 and len(test) == 10_000
    assert np.bincount(test.labels).tolist() == [1000] * 10
    held = open_split(tar, "train[98%:]")
    assert len(held) == 1000 and set(held.names).isdisjoint(train.names)
    img = train.load(0)
    assert img.shape == (3, 32, 32) and img.dtype == torch.uint8 and img.float().std() > 10


def _cifar(folder, batches):
    """A CIFAR-10 python-batches folder: ``batches`` (file name -> object) pickled as given."""
    import pickle

    folder.mkdir()
    for name, obj in batches.items():
        (folder / name).write_bytes(obj if isinstance(obj, bytes) else pickle.dumps(obj, protocol=2))
    return folder


def test_cifar_batches_are_read_without_running_code_and_malformed_ones_named(tmp_path):
    import pickle

    meta = {b"label_names": [b"cat", b"dog"]}
    ok = {b"data": np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072), b"labels": [0, 1],
          b"batch_label": b"testing batch 1 of 1", b"filenames": [b"a.png", b"b.png"]}
    good = _cifar(tmp_path / "good", {"batches.meta": meta, "test_batch": ok})
    src = open_split(good, "test")
    assert src.classes == ["cat", "dog"] and src.labels.tolist() == [0, 1]
    assert torch.equal(src.load(1), torch.from_numpy(ok[b"data"][1].reshape(3, 32, 32)))

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = _cifar(tmp_path / "evil", {"batches.meta": meta, "test_batch": pickle.dumps({b"data": Payload()})})
    with pytest.raises(DataError, match=r"cannot read CIFAR batch .*test_batch: refusing pathlib.*touch"):
        open_split(evil, "test")
    assert not marker.exists()  # nothing ran
    for name, obj, message in [
        ("not a dict", [1, 2], "a list, not the format's dict"),
        ("no labels", {b"data": ok[b"data"]}, r"malformed CIFAR batch .*test_batch: no b'labels' entry"),
        ("wrong shape", {**ok, b"data": np.zeros((2, 100), np.uint8)}, r"data uint8 \(2, 100\) with 2 labels"),
        ("bad label", {**ok, b"labels": [0, 7]}, r"labels outside 0\.\.1"),
        ("truncated", pickle.dumps(ok)[:50], "cannot read CIFAR batch"),
    ]:
        folder = _cifar(tmp_path / name.replace(" ", "_"), {"batches.meta": meta, "test_batch": obj})
        with pytest.raises(DataError, match=message):
            open_split(folder, "test")


def test_file_names_that_are_not_utf8_are_read_named_and_kept_as_bytes(tmp_path, capsysbinary):
    """``caf\\xe9.png`` (Latin-1, not UTF-8): read, named as ``caf\\xe9.png`` in messages; predict's JSON
    and CSV are valid UTF-8 (strict JSON and CSV readers take them) with the name escaped as ``caf\\xe9.png``,
    its bytes recoverable (JSON: ``path_bytes``; both: the documented ``\\xNN`` unescape); a prepare of
    the folder works too."""
    import csv
    import io
    import json
    import os
    import re

    from vitflow.cli import main

    root = make_folder(tmp_path / "ds", per_class=4)
    odd = os.fsencode(root / "a") + b"/caf\xe9.png"
    with open(odd, "wb") as f:
        f.write(encode(np.full((8, 8, 3), 90, np.uint8)))
    with open(os.fsencode(root / "b") + b"/bad\xff.png", "wb") as f:
        f.write(b"not an image")
    src = open_split(root, "train")
    names = [n for n in src.names if "caf" in n or "bad" in n]
    assert sorted(names) == sorted([f"{root}/a/caf\\xe9.png", f"{root}/b/bad\\xff.png"])
    i = src.names.index(f"{root}/a/caf\\xe9.png")
    assert src.load(i).shape == (3, 8, 8)
    with pytest.raises(CorruptImageError, match=r"bad\\xff\.png"):
        src.load(src.names.index(f"{root}/b/bad\\xff.png"))
    run = tmp_path / "run"
    assert main(["train", "-q", "--preset", "cifar10-vit-tiny", f"data.path={root}", "model.img_size=8",
                 "data.train_split=train[:75%]", "data.test_split=train[75%:]", "train.batch_size=4",
                 "train.total_steps=2", f"train.run_dir={run}"]) == 0
    capsysbinary.readouterr()

    def unescape(name: str) -> bytes:  # the recipe of docs/troubleshooting.md
        return re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes.fromhex(m[1].decode()), name.encode("utf-8"))

    assert main(["predict", str(run), str(root), "--json"]) == 0
    rows = [json.loads(line) for line in capsysbinary.readouterr().out.decode("utf-8", "strict").splitlines()]
    cafe = next(r for r in rows if "caf" in r["path"])
    assert cafe["path"] == f"{root}/a/caf\\xe9.png" and bytes.fromhex(cafe["path_bytes"]) == odd
    assert unescape(cafe["path"]) == odd and any("error" in r and r["path"].endswith("bad\\xff.png") for r in rows)
    assert all("path_bytes" not in r for r in rows if "caf" not in r["path"] and "bad" not in r["path"])
    assert main(["predict", str(run), str(root), "--csv"]) == 0
    table = list(csv.reader(io.StringIO(capsysbinary.readouterr().out.decode("utf-8", "strict"))))
    assert {unescape(r[0]) for r in table[1:]} == {unescape(r["path"]) for r in rows}
    assert odd in {unescape(r[0]) for r in table[1:]}
    assert main(["prepare", str(root), str(tmp_path / "packed")]) == 0
    assert b"bad\\xff.png" in capsysbinary.readouterr().err  # named once, printable


def test_a_tar_cut_at_a_member_boundary_is_warned(tmp_path, caplog):
    import tarfile

    root = make_folder(tmp_path / "ds", per_class=4)
    full = tar_folder(root, tmp_path / "full.tar")
    with tarfile.open(full) as tf:
        members = tf.getmembers()
    cut_at = members[-3].offset  # the header of a member near the end: an archive cut between members
    cut = tmp_path / "cut.tar"
    cut.write_bytes(full.read_bytes()[:cut_at])
    with caplog.at_level(logging.WARNING, logger="vitflow.data"):
        assert len(open_split(full, "train")) == 12
    assert "cut short" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="vitflow.data"):
        n = len(open_split(cut, "train"))
    assert n < 12 and "cut.tar ends right after its last member" in caplog.text and "may have been cut short" in caplog.text
    junk = tmp_path / "junk.tar"
    junk.write_bytes(full.read_bytes() + b"trailing garbage")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitflow.data"):
        open_split(junk, "train")
    assert "are not the zeros that end a tar" in caplog.text


def test_the_embedded_digits_are_scikit_learns_load_digits_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from vitflow.data.sources.digits import digits_arrays

    images, target = digits_arrays()
    d = load_digits()
    assert images.dtype == d.images.dtype and np.array_equal(images, d.images) and np.array_equal(target, d.target)
    out = subprocess.run([sys.executable, "-c", "import sys; from vitflow.data.sources.digits import digits_source; "
                          "s = digits_source(); print(len(s), 'sklearn' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1797", "False"]
