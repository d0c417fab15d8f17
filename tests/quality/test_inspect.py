"""``vitflow inspect`` end to end and its parts: label issues from out-of-sample probabilities,
faults, the files it writes, the fixes training takes (``data.exclude`` / ``data.relabel``), and
every bad input as one line with nothing written."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

import vitflow
from helpers import HYMENOPTERA_TAR, hymenoptera_subset, make_folder, need
from vitflow.config import DataConfig
from vitflow.data import open_split
from vitflow.data.fixes import image_key
from vitflow.data.sources.base import DataError
from vitflow.quality.labels import probe_probabilities, rank_label_issues


def test_probes_and_confident_learning_find_flipped_labels():
    """Three well-separated clusters, 10% of the labels flipped: the flagged images are the flipped ones."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 16)) * 4
    y = np.repeat(np.arange(3), 100)
    x = (centers[y] + rng.normal(size=(300, 16))).astype(np.float32)
    noisy = y.copy()
    flipped = rng.choice(300, 30, replace=False)
    noisy[flipped] = (y[flipped] + rng.integers(1, 3, 30)) % 3
    oof, (held,) = probe_probabilities(x, noisy, 3, [x[:10]])
    assert oof.shape == (300, 3) and held.shape == (10, 3) and np.allclose(oof.sum(1), 1, atol=1e-5)
    rows, quality, suggested = rank_label_issues(noisy, oof)
    top = set(rows[:30].tolist())
    assert len(top & set(flipped.tolist())) >= 27  # precision and recall at N = 30: >= 90%
    assert (suggested[:len(rows)][np.isin(rows, flipped)] == y[rows[np.isin(rows, flipped)]]).mean() > 0.9
    assert (np.diff(quality) >= -1e-6).all()  # worst first


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """12 hymenoptera photos a class in train, 6 in val, one val photo copied into train, one broken
    file and one blank image in train."""
    root = tmp_path_factory.mktemp("photos")
    hymenoptera_subset(root, (("train", 12), ("val", 6)))
    val = sorted((root / "val" / "ants").iterdir())[0]
    (root / "train" / "ants" / "leaked.jpg").write_bytes(val.read_bytes())
    (root / "train" / "bees" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    from PIL import Image
    Image.new("RGB", (200, 150), (3, 3, 3)).save(root / "train" / "bees" / "blank.png")
    return root


def test_inspect_writes_findings_page_and_fixes_that_training_takes(photos, tiny_run, tmp_path, caplog):
    run_dir, _ = tiny_run
    out = tmp_path / "inspect"
    with caplog.at_level(logging.WARNING):
        df = vitflow.inspect(str(photos), model=str(run_dir), out=out)
    assert "trained on 10 other classes" in caplog.text  # the digits model as a frozen backbone: said once
    kinds = dict(df.groupby("finding").size())
    assert kinds["leak"] == 1 and kinds["broken"] == 1 and kinds["near_constant"] == 1
    leak = df[df.finding == "leak"].iloc[0]
    assert (leak.key, leak.split, leak.other_split, leak.action) == ("train/ants/leaked.jpg", "train", "val", "exclude")
    assert "dark" in df[df.finding == "near_constant"].iloc[0].detail
    assert not ((df.split != "train") & (df.action == "exclude")).any()  # held-out splits change by hand only
    issues = df[df.finding == "label_issue"]
    assert set(issues.action) <= {"exclude", "review"}
    assert {p.name for p in out.iterdir()} >= {"index.html", "findings.csv", "findings.json", "exclude.txt",
                                               "relabel.csv", "summary.json"}
    assert len(json.loads((out / "findings.json").read_text())) == len(df)
    page = (out / "index.html").read_text()
    assert "Leaks" in page and "leaked.jpg" in page and "data:image/jpeg;base64," in page
    excluded = [line for line in (out / "exclude.txt").read_text().splitlines() if line and line[0] != "#"]
    assert {"train/ants/leaked.jpg", "train/bees/broken.jpg"} <= set(excluded)
    assert "train/bees/blank.png" not in excluded  # near-constant: for review (a satellite's sea tiles are flat too)
    before = len(open_split(str(photos), "train"))
    cfg = DataConfig(path=str(photos), exclude=str(out / "exclude.txt"))
    assert len(open_split(cfg.path, "train", cfg=cfg)) == before - len(set(excluded) & _train_keys(photos))
    again = vitflow.inspect(str(photos), model=str(run_dir), out=out)  # an earlier inspect's folder: updated
    assert len(again) == len(df)


def _train_keys(root):
    return {str(p.relative_to(root)) for p in (root / "train").rglob("*") if p.is_file()}


def test_relabel_and_exclude_in_every_split(photos, tmp_path, caplog):
    (tmp_path / "ex.txt").write_text("# a comment\ntrain/ants/leaked.jpg\n\n" + str(sorted((photos / "val" / "bees")
                                     .iterdir())[0]) + "\n")  # a key, and a full path
    bee = sorted((photos / "train" / "bees").glob("*.jpg"))[0].name
    (tmp_path / "re.csv").write_text(f"path,label,given\ntrain/bees/{bee},ants,bees\ntrain/ants/leaked.jpg,bees,ants\n")
    cfg = DataConfig(path=str(photos), exclude=str(tmp_path / "ex.txt"), relabel=str(tmp_path / "re.csv"))
    plain = DataConfig(path=str(photos))
    tr, tr0 = open_split(cfg.path, "train", cfg=cfg), open_split(plain.path, "train", cfg=plain)
    va, va0 = open_split(cfg.path, "val", cfg=cfg), open_split(plain.path, "val", cfg=plain)
    assert len(tr) == len(tr0) and len(va) == len(va0) - 1  # leaked.jpg is relabelled (both lists), not dropped
    names = [n.rsplit("/", 1)[-1] for n in tr.names]
    assert tr.labels[names.index(bee)] == 0 and tr.labels[names.index("leaked.jpg")] == 1
    assert (tr.labels != tr0.labels).sum() == 2
    (tmp_path / "bad.csv").write_text(f"path,label\ntrain/bees/{bee},wasps\n")
    with pytest.raises(DataError, match=r"wasps.*is not a class of the data"):
        open_split(cfg.path, "train", cfg=DataConfig(path=str(photos), relabel=str(tmp_path / "bad.csv")))
    (tmp_path / "other.txt").write_text("photos/train/ants/a.jpg\n")  # keys of another root: said, nothing lost
    with caplog.at_level(logging.WARNING, logger="vitflow.data.fixes"):
        tr = open_split(cfg.path, "train", cfg=DataConfig(path=str(photos), exclude=str(tmp_path / "other.txt")))
    assert len(tr) == len(tr0)
    said = [r.getMessage() for r in caplog.records if "none of its 1 image key" in r.getMessage()]
    assert len(said) == 1 and "other.txt" in said[0] and "'train/ants/" in said[0]


@pytest.mark.parametrize("case", ["empty", "one class", "foreign output", "bad override"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, tiny_run):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    args = [str(data), "--model", str(tiny_run[0]), "-o", str(out)]
    if case == "one class":
        make_folder(data, classes=("only",), split="train")
    elif case in ("foreign output", "bad override"):
        make_folder(data, classes=("a", "b"), split="train")
        if case == "foreign output":
            out.mkdir()
            (out / "mine.txt").write_text("keep me")
            (out / "summary.json").write_text('{"x": 1}')  # someone else's summary: still refused
        else:
            args.append("train.lr=1")
    r = subprocess.run([sys.executable, "-m", "vitflow", "inspect", *args], capture_output=True, text=True)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert {"empty": "no image", "one class": "one class", "foreign output": "not an earlier vitflow inspect",
            "bad override": "data.key=value"}[case] in errors[0].lower() or case == "empty"
    if case == "foreign output":
        assert sorted(p.name for p in out.iterdir()) == ["mine.txt", "summary.json"]
        assert (out / "summary.json").read_text() == '{"x": 1}'
    else:
        assert not out.exists()


def test_kfold_path_trains_each_fold_without_its_images(photos, tmp_path):
    """Without --model: two runs, each with its fold excluded, score the images they never saw."""
    from vitflow.api.quality import fold_of

    out = tmp_path / "kfold-inspect"
    df = vitflow.inspect(str(photos), time_budget="20s", out=out, folds=2)
    excluded = [set((out / "kfold" / f"fold-{f}.exclude.txt").read_text().split()) for f in (0, 1)]
    assert excluded[0] and excluded[1] and not excluded[0] & excluded[1]
    assert excluded[0] | excluded[1] == _train_keys(photos)  # every training image is scored out of its fold
    for f in (0, 1):
        config = (out / "kfold" / f"fold-{f}" / "config.yaml").read_text()
        assert f"fold-{f}.exclude.txt" in config  # the run's config records the fix it trained with
        page = (out / "kfold" / f"fold-{f}" / "report.html").read_text()
        assert "Data fixes" in page and f"{len(excluded[f])} image(s) listed to drop" in page
    assert "2-fold training" in df.attrs["summary"]["labels"]
    assert dict(df.groupby("finding").size())["leak"] == 1
    labels = np.repeat([0, 1, 2], [7, 8, 9])
    fold = fold_of(labels, 2, 0)
    assert all(abs((fold[labels == c] == 0).sum() - (fold[labels == c] == 1).sum()) <= 1 for c in range(3))


def test_a_tar_read_in_place_has_no_false_copies_and_its_fixes_apply(tiny_run, tmp_path):
    """The real hymenoptera tar as it is: no leak or copy is invented among its 398 photos; the
    fix files name tar members, and training's reader takes them."""
    tar = need(HYMENOPTERA_TAR)
    df = vitflow.inspect(str(tar), model=str(tiny_run[0]), out=tmp_path / "out")
    assert not df["finding"].isin(["leak", "exact_duplicate", "near_duplicate", "broken"]).any()
    assert df.attrs["summary"]["images"] == {"train": 245, "val": 153}
    member = image_key(open_split(str(tar), "train"), 0)
    assert member == "hymenoptera/train/ants/0013035.jpg"  # a member name, as the fix files write it
    (tmp_path / "ex.txt").write_text(member + "\n")
    cfg = DataConfig(path=str(tar), exclude=str(tmp_path / "ex.txt"))
    assert len(open_split(cfg.path, "train", cfg=cfg)) == 244
