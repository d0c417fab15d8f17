"""The plan suite's tools: ``benchmarks/folders/fetch.py`` builds a folder from one commit of a git
repository (split by a hash of the path where the source has none, checked against its sha256,
never overwriting another folder), and ``benchmarks/plan_suite.py``'s table (seed spread, the
median over folders, the folders where a tree is behind by more than the spread)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import encode

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str, path: Path):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch = _module("fetch", ROOT / "benchmarks" / "folders" / "fetch.py")
suite = _module("plan_suite", ROOT / "benchmarks" / "plan_suite.py")


def _repo(tmp_path: Path) -> tuple[Path, str]:
    """A git repository (as a mirror: MIRRORS/owner+name/repo) with 20 images in each of two
    class folders, a README and a stray non-image file; returns (mirrors, commit)."""
    repo = tmp_path / "mirrors" / "someone+photos" / "repo"
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        folder = repo / "Dataset" / cls
        folder.mkdir(parents=True)
        for i in range(20):
            (folder / f"img {i}.jpg").write_bytes(encode(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), "JPEG"))
        (folder / "Thumbs.db").write_bytes(b"x")
    (repo / "README.md").write_text("photos")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "photos"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return tmp_path / "mirrors", commit


def test_fetch_builds_a_split_folder_from_a_commit_and_checks_its_sha256(tmp_path):
    mirrors, commit = _repo(tmp_path)
    entry = {"name": "pets", "source": {"repo": "someone/photos", "commit": commit, "take": {"Dataset": ""}}, "sha256": ""}
    out = tmp_path / "out"
    folder = fetch.build(entry, out, mirrors)
    counts = {split: sorted(len(list((folder / split / c).iterdir())) for c in ("cats", "dogs"))
              for split in ("train", "val", "test")}
    assert counts == {"train": [14, 14], "val": [3, 3], "test": [3, 3]}  # 70 / 15 / 15 of 20 a class
    assert not list(folder.rglob("Thumbs.db")) and not list(folder.rglob("README.md"))  # images only
    digest = fetch.listing_sha256(folder)
    # the same commit gives the same folder (and the same split) anywhere: built again, the digest matches
    again = fetch.build({**entry, "name": "pets2", "sha256": digest}, out, mirrors)
    assert fetch.listing_sha256(again) == digest
    assert sorted(p.name for p in (again / "test" / "cats").iterdir()) == sorted(
        p.name for p in (folder / "test" / "cats").iterdir())
    assert fetch.build({**entry, "sha256": digest}, out, mirrors) == folder  # present and matching: kept
    (folder / "train" / "cats" / "extra.jpg").write_bytes(b"mine")
    with pytest.raises(SystemExit, match="exists and its sha256 is not the manifest's"):
        fetch.build({**entry, "sha256": digest}, out, mirrors)
    assert (folder / "train" / "cats" / "extra.jpg").read_bytes() == b"mine"  # nothing overwritten
    with pytest.raises(SystemExit, match="is not the manifest's"):
        fetch.build({**entry, "name": "pets3", "sha256": "0" * 64}, out, mirrors)
    # a subset per class, in numeric order of the names
    some = fetch.build({**entry, "name": "some", "source": {**entry["source"], "per_class": 10, "order": "numeric"}},
                       out, mirrors)
    names = sorted(p.name for p in some.rglob("*.jpg") if p.parent.name == "cats")
    assert names == sorted(f"img {i}.jpg" for i in range(10))


def test_every_manifest_folder_names_its_commit_licence_and_sha256():
    entries = fetch.load_manifest()
    fetched = [e for e in entries if "source" in e]
    assert len(fetched) >= 6 and len({e["kind"].split(":")[0] for e in fetched}) >= 5
    for e in fetched:
        assert len(e["source"]["commit"]) == 40 and len(e["sha256"]) == 64 and e["licence"] and e["licence_evidence"]
        assert 500 <= e["images"] <= 20_000
    assert {e["name"] for e in entries if "shared" in e} == {"cifar10", "hymenoptera"}


def test_the_table_says_the_spread_the_median_and_who_is_behind():
    def row(label, folder, seed, top1):
        return {"label": label, "folder": folder, "seed": seed, "test_top1": top1, "val_top1": None,
                "test_macro_f1": top1 - 0.01, "ratio_to_expected": 1.0, "planned_all_in_step_s": 0.8,
                "measured_step_s": 1.0}
    rows = [row("before", "a", 0, 0.50), row("before", "a", 1, 0.54), row("now", "a", 0, 0.40), row("now", "a", 1, 0.42),
            row("before", "b", 0, 0.80), row("before", "b", 1, 0.81), row("now", "b", 0, 0.79), row("now", "b", 1, 0.83)]
    text = suite.table(rows, ["before", "now"], ["a", "b"])
    assert "a                    before    50.0  54.0                  52.0    4.0" in text
    assert "before: median over 2 folders of the mean top-1: 66.2%" in text
    assert "now behind before by more than the seed spread on: a (-11.0)" in text  # b: within its spread
    assert "now - before, folder by folder: median -5.2 points, ahead on 1 of 2" in text  # -11.0 and +0.5
    assert " 0.80" in text  # the planned step over the run's


def test_a_race_winners_own_time_leaves_out_the_other_candidates_rung():
    """The winner's step time in a raced run: each ``start`` record (its rung, its continuation) to
    the last record before the next, not the other candidate's rung between them."""
    budget = _module("photos_budget", ROOT / "benchmarks" / "training" / "photos_budget.py")
    records = [{"kind": "start", "time": 100.0}, {"kind": "train", "time": 130.0}, {"kind": "eval", "time": 160.0},
               {"kind": "start", "time": 230.0}, {"kind": "train", "time": 300.0}, {"kind": "summary", "time": 310.0}]
    assert budget._own_seconds(records) == pytest.approx(60.0 + 80.0)  # 160 - 100, 310 - 230: not 210
    assert budget._own_seconds(records[:3]) == pytest.approx(60.0)
