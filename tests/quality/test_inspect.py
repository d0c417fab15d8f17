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
from vitflow.quality.inspection import label_rows
from vitflow.quality.labels import probe_probabilities, rank_label_issues
from vitflow.quality.scan import SplitScan


def _flipped_clusters(scale: float):
    """300 points in three Gaussian clusters (centres ``scale`` apart in 16-D), 30 labels flipped:
    ``(x, true labels, given labels, flipped rows)``."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 16)) * scale
    y = np.repeat(np.arange(3), 100)
    x = (centers[y] + rng.normal(size=(300, 16))).astype(np.float32)
    noisy = y.copy()
    flipped = rng.choice(300, 30, replace=False)
    noisy[flipped] = (y[flipped] + rng.integers(1, 3, 30)) % 3
    return x, y, noisy, flipped


def test_probes_and_confident_learning_find_flipped_labels():
    """Three well-separated clusters, 10% of the labels flipped: the flagged images are the flipped ones."""
    x, y, noisy, flipped = _flipped_clusters(4.0)
    oof, (held,) = probe_probabilities(x, noisy, 3, [x[:10]])
    assert oof.shape == (300, 3) and held.shape == (10, 3) and np.allclose(oof.sum(1), 1, atol=1e-5)
    rows, quality, suggested = rank_label_issues(noisy, oof)
    top = set(rows[:30].tolist())
    assert len(top & set(flipped.tolist())) >= 27  # precision and recall at N = 30: >= 90%
    assert (suggested[:len(rows)][np.isin(rows, flipped)] == y[rows[np.isin(rows, flipped)]]).mean() > 0.9
    assert (np.diff(quality) >= -1e-6).all()  # worst first


def test_label_cut_sets_which_flagged_training_labels_exclude_txt_drops():
    """Overlapping clusters: confident learning flags more than the surest; the default cut (0.5 / classes)
    drops only those below it, ``label_cut=1`` every one flagged; a held-out split's are for review."""
    x, _, noisy, _ = _flipped_clusters(0.8)
    oof, (held,) = probe_probabilities(x, noisy, 3, [x])
    keys = [f"k{i}" for i in range(300)]
    scans = [SplitScan(split, ["a", "b", "c"], keys, keys, noisy, error=[""] * 300) for split in ("train", "test")]
    probs = {"train": oof, "test": held}
    by_cut = {}
    for cut in (None, 0.5, 1.0):
        rows = [r for r in label_rows(scans, probs, cut) if r["split"] == "train"]
        by_cut[cut] = {r["key"] for r in rows if r["action"] == "exclude"}
        given = {r["key"]: 1 - r["score"] for r in rows}  # score: 1 - the given class's probability
        assert by_cut[cut] == {k for k, q in given.items() if q < (0.5 / 3 if cut is None else cut)}
    assert by_cut[None] < by_cut[0.5] <= by_cut[1.0] and len(by_cut[1.0]) == len(given) > len(by_cut[None])
    assert all(r["action"] == "review" for r in label_rows(scans, probs, 1.0) if r["split"] == "test")


def test_embeddings_fitted_to_the_training_labels_are_said_once(caplog):
    """Probes on embeddings: when the training images' embeddings carry their given labels (wrong ones
    too: the model trained on them) and the held-out ones do not separate, the training split's issues
    are under-found and one line says so; embeddings alike in both splits: silence."""
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(3), 100)
    noisy = y.copy()
    flipped = rng.choice(300, 30, replace=False)
    noisy[flipped] = (y[flipped] + 1) % 3
    keys = [f"k{i}" for i in range(300)]
    centers = rng.normal(size=(3, 16)) * 2
    fitted = (np.eye(3, 16)[noisy] * 4 + rng.normal(size=(300, 16)) * 0.3).astype(np.float32)  # labels memorized
    unseen = (centers[y] + rng.normal(size=(300, 16)) * 3).astype(np.float32)  # held-out: barely separated
    alike = (centers[y] + rng.normal(size=(300, 16))).astype(np.float32)
    for train_x, test_x, said in ((fitted, unseen, True), (alike, (centers[y] + rng.normal(size=(300, 16))
                                                                   ).astype(np.float32), False)):
        scans = [SplitScan(split, ["a", "b", "c"], keys, keys, labels, error=[""] * 300, features=x)
                 for split, labels, x in (("train", noisy, train_x), ("test", y, test_x))]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vitflow.quality.inspection"):
            rows = label_rows(scans, None)
        lines = [r.getMessage() for r in caplog.records if "under-found" in r.getMessage()]
        train_flagged = sum(r["split"] == "train" for r in rows)
        assert len(lines) == int(said), (lines, train_flagged)
        if said:
            assert train_flagged < 10 and "k-fold" in lines[0]  # 30 flipped, almost none found


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
    assert df.attrs["summary"]["label_cut"] == 0.25  # 0.5 / 2 classes
    again = vitflow.inspect(str(photos), model=str(run_dir), out=out, label_cut=1.0)  # an earlier inspect's: updated
    assert len(again) == len(df) and again.attrs["summary"]["label_cut"] == 1.0
    assert (again[(again.finding == "label_issue") & (again.split == "train")].action == "exclude").all()


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


@pytest.mark.parametrize("case", ["empty", "one class", "foreign output", "bad override", "bad label cut"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, tiny_run):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    args = [str(data), "--model", str(tiny_run[0]), "-o", str(out)]
    if case == "one class":
        make_folder(data, classes=("only",), split="train")
    elif case in ("foreign output", "bad override", "bad label cut"):
        make_folder(data, classes=("a", "b"), split="train")
        if case == "foreign output":
            out.mkdir()
            (out / "mine.txt").write_text("keep me")
            (out / "summary.json").write_text('{"x": 1}')  # someone else's summary: still refused
        else:
            args += ["train.lr=1"] if case == "bad override" else ["--label-cut", "1.5"]
    r = subprocess.run([sys.executable, "-m", "vitflow", "inspect", *args], capture_output=True, text=True)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert {"empty": "no image", "one class": "one class", "foreign output": "not an earlier vitflow inspect",
            "bad override": "data.key=value", "bad label cut": "label_cut=1.5"}[case] in errors[0].lower() or case == "empty"
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
