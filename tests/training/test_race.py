"""The race of a planned run (``train.race``): successive halving's rungs and their share of the
budget, the winner called only where the paired interval separates it (else the cheaper one), the
plan's rule (raced families, no race without a budget, a validation split or the time for a rung),
the validation split held out of data without one, and a real race on the hymenoptera photos: the
candidates trained and halved, the winner's folder continued as the run within what is left of the
budget, the record and the report's section."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_plan import CLOCK, HYMENOPTERA, plan

from helpers import HYMENOPTERA_TAR, cifar_subset, need
from vitflow.cli.commands import CONFIG_CHECKS
from vitflow.config import ConfigError, build_config
from vitflow.data import DataError
from vitflow.data.sources.splits import parse_split
from vitflow.training import train
from vitflow.training.plan.recipe import planned_config
from vitflow.training.plan.rivals import RACE_SHARE, halving, rung_seconds
from vitflow.training.plan.rules import run_rules
from vitflow.training.race import Entrant, rank, verdict

PHOTOS = dataclasses.replace(HYMENOPTERA, val_images=153)
FAMILIES = "vit_compact_patch8_64,mvitv2_compact_64,swin_compact_patch4_window4_64"


@pytest.mark.parametrize("n,counts", [(2, [2]), (3, [3, 2]), (4, [4, 2]), (5, [5, 3, 2]), (8, [8, 4, 2])])
def test_halving_keeps_the_better_half_until_two_and_the_losers_get_the_race_share(n, counts):
    assert halving(n) == counts
    rung = rung_seconds(300, n)
    losers = (sum(counts) - len(counts)) * rung  # every rung's candidates but the one that goes on
    assert losers == pytest.approx(RACE_SHARE * 300)
    assert rung_seconds(300, 3) == pytest.approx(20.0)


def _entrant(name: str, hits: np.ndarray, images_per_s: float) -> Entrant:
    return Entrant(name, None, Path(name), seconds=10.0, images=int(images_per_s * 10), hits=hits)


def test_a_costlier_candidate_ranks_higher_only_where_the_paired_interval_separates_it():
    rng = np.random.default_rng(0)
    base = rng.random(400) < 0.6
    better = base.copy()
    better[np.flatnonzero(~base)[:40]] = True  # right on 40 more images, wrong on none the other gets
    close = base.copy()
    close[np.flatnonzero(~base)[:6]] = True  # +1.0 point: within the noise of 400 images
    close[np.flatnonzero(base)[:2]] = False
    vit, mvit = _entrant("vit", base, 130.0), _entrant("mvit", better, 80.0)
    assert [e.name for e in rank([vit, mvit])] == ["mvit", "vit"]
    assert verdict(mvit, vit).startswith("mvit leads vit by +10.0 points [+") and "400 images" in verdict(mvit, vit)
    swin = _entrant("swin", close, 100.0)
    assert [e.name for e in rank([swin, vit])] == ["vit", "swin"]  # ahead within the noise: the cheaper kept
    assert "cannot separate: the cheaper vit (130 img/s against 100) is kept" in verdict(vit, swin)
    # three: the costliest is separated from both, the other two are not separated from each other
    assert [e.name for e in rank([swin, mvit, vit])] == ["mvit", "vit", "swin"]
    # the cheaper candidate does not climb over one that is separated from it, however cheap
    assert [e.name for e in rank([_entrant("fast", base, 500.0), mvit])] == ["mvit", "fast"]
    # candidates that scored other images (other input sizes): their Wilson intervals must not overlap
    other = _entrant("other", np.ones(300, dtype=bool), 50.0)
    assert [e.name for e in rank([vit, other])] == ["other", "vit"]
    assert verdict(other, vit) == f"other leads vit by 100.0% against {100 * base.mean():.1f}% (on 300 and 400 images)"


def test_the_plan_races_the_families_only_with_a_budget_a_validation_split_and_time_for_a_rung():
    assert plan(PHOTOS)["train.race"] == FAMILIES  # the default 15-minute budget: 60-s rungs
    cifar = dataclasses.replace(PHOTOS, short_side=32, uniform=True)
    assert plan(cifar, **{"train.default_budget": "20m"})["train.race"] == (
        "vit_cifar_patch4_32,mvitv2_cifar_32,swin_cifar_patch2_window4_32")

    def why(facts, **user):
        values = {**plan(facts, **user)}
        facts = dataclasses.replace(facts, user=frozenset(user))
        return dict((k, (v, w)) for k, v, w in run_rules(facts, values, 1)).get("train.race")

    assert why(PHOTOS, **{"train.default_budget": "5m"}) == (
        "none", "train.time_budget=5m would give each of 3 candidates 20 s a rung, under 60 s: no race")
    assert why(HYMENOPTERA)[0] == "none" and "no validation split" in why(HYMENOPTERA)[1]
    assert why(PHOTOS, **{"train.total_steps": 300})[0] == "none"  # the user's steps: no budget to race in
    assert why(PHOTOS, **{"model.name": "vit_small_patch16_224"}) is None  # a named model is not raced
    assert why(dataclasses.replace(PHOTOS, device="cuda")) is None  # a GPU's ViT-Tiny/16 has no rivals listed
    assert plan(PHOTOS, **{"train.race": "none"})["train.race"] == "none"


def test_train_race_names_two_models_or_more():
    for value, said in (("vit_compact_patch8_64", "two model names or more"),
                        ("vit_compact_patch8_64,mvit_nope", "mvit_nope is not a model")):
        with pytest.raises(ConfigError, match=said):
            build_config("photos-auto", overrides=[f"train.race={value}"], checks=CONFIG_CHECKS)


def test_data_without_a_validation_split_gets_one_held_out_of_train(tmp_path: Path, monkeypatch, caplog):
    """CIFAR-like data (train and test only): a slice of the training images is held out as the
    validation split the run (and a race) chooses on; the test split only reports."""
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    folder = cifar_subset(tmp_path / "cifar", n_train=400, n_test=60)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={folder}"], CONFIG_CHECKS)  # the default 15 minutes: a race
    assert (cfg.data.train_split, cfg.data.val_split) == ("train[:-40]", "train[-40:]")
    assert "plan: data.val_split=train[-40:]  (the data has no validation split: 40 of the 400 training images" in (
        caplog.text)
    assert cfg.train.race == "vit_cifar_patch4_32,mvitv2_cifar_32,swin_cifar_patch2_window4_32"
    small = cifar_subset(tmp_path / "small", n_train=200, n_test=20)  # too few to hold any out
    assert planned_config([f"data.path={small}", "train.default_budget=5m"], CONFIG_CHECKS).data.val_split == "auto"
    user = planned_config([f"data.path={folder}", "train.default_budget=5m", "data.val_split=test"], CONFIG_CHECKS)
    assert (user.data.train_split, user.data.val_split) == ("train", "test")



def test_a_folder_of_class_folders_gets_validation_and_test_held_out(tmp_path: Path, monkeypatch, caplog):
    """Class folders and nothing else (no train / val / test): the plan holds out a validation
    slice to choose on and a test slice to score the finished model on, disjoint from each other and
    from training; with too few images to hold any out, the data's message comes before any timing."""
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    folder = cifar_subset(tmp_path / "cifar", n_train=400, n_test=1) / "train"  # <class>/<image>.jpg
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={folder}", "train.default_budget=5m"], CONFIG_CHECKS)
    d = cfg.data
    assert (d.train_split, d.val_split, d.test_split) == ("train[:-80]", "train[-80:-40]", "train[-40:]")
    assert "40 of the 400 images held out as the validation split" in caplog.text
    parts = [parse_split(s).select(400) for s in (d.train_split, d.val_split, d.test_split)]
    assert [len(p) for p in parts] == [320, 40, 40] and len(set(np.concatenate(parts))) == 400
    user = planned_config([f"data.path={folder}", "train.default_budget=5m", "data.test_split=none"], CONFIG_CHECKS)
    assert (user.data.train_split, user.data.val_split, user.data.test_split) == ("train[:-40]", "train[-40:]", "none")
    small = cifar_subset(tmp_path / "small", n_train=200, n_test=1) / "train"
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: pytest.fail("timed"))
    with pytest.raises(DataError, match="has no validation or test split"):
        planned_config([f"data.path={small}", "train.default_budget=5m"], CONFIG_CHECKS)

def test_a_race_on_real_photos_halves_the_families_and_continues_the_winner_within_the_budget(tmp_path: Path,
                                                                                                caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={need(HYMENOPTERA_TAR)}", f"train.run_dir={run}", "train.default_budget=60s",
                              f"train.race={FAMILIES}", "train.log_every=2"], CONFIG_CHECKS)
        summary = train(cfg)
    record = json.loads((run / "race" / "race.json").read_text())
    assert summary["race"] == record and set(record["candidates"]) == set(FAMILIES.split(","))
    assert set(record["planned_step_s"]) == set(FAMILIES.split(","))  # each one's plan, all costs in
    assert all(0 < s < 10 for s in record["planned_step_s"].values())
    rungs = {name: len(done) for name, done in record["candidates"].items()}
    assert sorted(rungs.values()) == [1, 2, 2]  # three trained a rung, the better two another
    winner = record["winner"]
    assert rungs[winner] == 2 and record["why"] and f"race: {winner} wins: " in caplog.text
    for name, done in record["candidates"].items():
        assert [r["rung"] for r in done] == list(range(1, len(done) + 1))
        assert all(0 <= r["top1_ci95"][0] <= r["top1"] <= r["top1_ci95"][1] <= 1 for r in done)
        assert (run / "race" / name).is_dir() == (name != winner)  # the winner's folder became the run
    for name in record["candidates"]:  # the plan's model keeps its rule (math); the others time their backends
        folder = run if name == winner else run / "race" / name
        attention = yaml.safe_load((folder / "config.yaml").read_text())["model"]["attention"]
        assert attention == ("math" if name == cfg.model.name else "auto")
    # the winner continued from its weights: the run's records begin at its first steps, and go on past the race
    saved = build_config(config_file=run / "config.yaml", checks=CONFIG_CHECKS)
    assert saved.model.name == winner and summary["run_dir"] == str(run)
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    race_steps = record["candidates"][winner][-1]["steps"]
    assert min(r["step"] for r in records if r["kind"] == "train") <= 2 < race_steps < summary["step"]
    # what is left of the budget after the race, and the run kept it
    left = max(1.0, 60 - record["race_s"])
    assert saved.train.time_budget == f"{left:.0f}s" and summary["elapsed_s"] <= left * 1.15 + 5
    from vitflow.viz.report import write_report

    write_report(run)
    page = (run / "report.html").read_text()
    assert "<h2>Race</h2>" in page and f"{winner} (winner)" in page and "rung 2" in page


def test_runs_inside_shared_datasets_open_and_decode_the_splits_once():
    """The race's runs follow one another in one process: one data section at one input size is
    opened (and decoded into RAM) once inside ``shared_datasets``, as often as asked outside it."""
    import copy

    from vitflow.training.normalize import open_run_datasets, shared_datasets
    from vitflow.training.scale.distributed import DistEnv

    d = build_config("photos-auto", overrides=[f"data.path={need(HYMENOPTERA_TAR)}"], checks=CONFIG_CHECKS).data
    with shared_datasets():
        first = open_run_datasets(d, 64, DistEnv(), None)
        assert open_run_datasets(copy.deepcopy(d), 64, DistEnv(), None) is first
        assert open_run_datasets(d, 32, DistEnv(), None) is not first  # another input size: other pixels
    assert open_run_datasets(d, 64, DistEnv(), None) is not first


def test_a_candidate_that_fails_is_dropped_and_the_race_goes_on(tmp_path: Path, monkeypatch, caplog):
    """The race's bookkeeping with the training stubbed: a candidate whose rung raises is dropped
    with one line and recorded, the others are halved and the winner's folder becomes the run's."""
    import copy

    from vitflow.training import race as race_module

    cfg = build_config("photos-auto", overrides=[f"train.run_dir={tmp_path / 'run'}", "train.time_budget=5m",
                                                  f"train.race={FAMILIES}"], checks=CONFIG_CHECKS)
    cfg.plan_candidate = lambda name: copy.deepcopy(cfg)
    right = {"vit_compact_patch8_64": 0.5, "mvitv2_compact_64": 0.9}

    def rung(e, k, seconds, winner_s):
        if e.name.startswith("swin"):
            raise RuntimeError("non-finite loss in 10 steps in a row\n(details)")
        e.folder.mkdir(parents=True, exist_ok=True)
        (e.folder / "metrics.jsonl").write_text(f"{e.name} rung {k + 1}\n")
        e.seconds, e.images, e.steps = e.seconds + seconds, e.images + 2000, e.steps + 10
        e.hits = np.arange(200) < 200 * right[e.name]
        e.rungs.append({"rung": k + 1, "seconds": e.seconds, "steps": e.steps, "top1": e.top1, "top1_ci95": [0, 1]})

    monkeypatch.setattr(race_module, "_rung", rung)
    with caplog.at_level(logging.WARNING, logger="vitflow"):
        out, record = race_module.race(cfg)
    assert "race: swin_compact_patch4_window4_64 dropped in rung 1: non-finite loss in 10 steps in a row" in caplog.text
    assert record["candidates"]["swin_compact_patch4_window4_64"] == [
        {"rung": 1, "error": "non-finite loss in 10 steps in a row"}]
    assert record["winner"] == "mvitv2_compact_64" and "leads vit_compact_patch8_64 by +40.0 points" in record["why"]
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").read_text() == "mvitv2_compact_64 rung 2\n" and not (run / "race" / "mvitv2_compact_64").exists()
    assert out.train.run_dir == str(run) and out.train.resume == "auto"
    assert out.train.time_budget == f"{300 - record['race_s']:.0f}s"
    assert json.loads((run / "race" / "race.json").read_text()) == record
