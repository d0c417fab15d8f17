"""The run planned from the data and the clock (``vitflow train data.path=PHOTOS`` with no preset):
the choices and their reasons, the length fitted to a default time budget on a CPU, evaluations
spaced in time, every planned key's dependents following a key the user sets, the expectations
printed before step 1, the size warnings, and real photo folders (the hymenoptera photos, the
ImageNet sample re-labelled into a few classes through a label file) trained end to end on the
batched in-RAM path."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tarfile
from pathlib import Path

import pytest

from helpers import CIFAR_TAR, HYMENOPTERA_TAR, IMAGENET_TAR, hymenoptera_subset, need, write_csv
from vitflow.cli.commands import CONFIG_CHECKS
from vitflow.config import build_config, parse_duration
from vitflow.config.build import flatten
from vitflow.models import config_class, create_model, model_args
from vitflow.training import train
from vitflow.training.plan import clock as clock_module
from vitflow.training.plan.clock import Clock
from vitflow.training.plan.recipe import DataProfile, expectations, is_planned, planned_config, size_warnings
from vitflow.training.plan.rules import RULES, Facts, expected_steps, run_rules

SHORT = ["train.total_steps=3", "train.log_every=1"]  # keys the user sets: the plan leaves them alone
CLOCK = Clock(step_s=0.5, eval_image_s=0.002, decode_s=0.004, precision="fp32", threads=2,
              by_threads={1: 0.8, 2: 0.5}, probe_s=3.0)
HYMENOPTERA = Facts(245, 2, 355, device="cpu", eval_images=153, final_images=153, clock=CLOCK)


def plan(facts: Facts, **user) -> dict:
    """The photo preset's values after both phases of the rules, with ``user`` keys set by the user."""
    values = {**flatten(build_config("photos-auto").to_dict()), **user}
    named = user.get("model.name") if facts.source is None else None
    facts = dataclasses.replace(facts, user=frozenset(user), named=named)
    run_rules(facts, values, 0)
    run_rules(facts, values, 1)
    return values


def consistent(f: Facts, v: dict, user: set[str]) -> None:
    """What the plan promises, re-derived from its stated rules: each planned key follows the
    values it depends on (the user's where set)."""
    steps = expected_steps(dataclasses.replace(f, user=frozenset(user)), v)
    epochs = steps * v["train.batch_size"] / f.images
    planned = {r.key for r in RULES} - user
    if "model.patch_size" in planned and "model.name" not in user:
        assert v["model.img_size"] // v["model.patch_size"] == 8
    if "optim.lr" in planned:
        assert v["optim.lr"] == pytest.approx(7e-4 * math.sqrt(v["train.batch_size"] / 128), rel=0.03)
    if "optim.warmup_steps" in planned:
        assert v["optim.warmup_steps"] == max(1, round(steps / 20))
    if "train.total_steps" in planned and v["train.time_budget"]:
        assert steps < v["train.total_steps"] <= 1.2 * steps + 1  # headroom over the budget's fit
    if "train.checkpoint_every" in planned:
        assert v["train.checkpoint_every"] == v["train.eval_every"]
    if "train.eval_every" in planned:
        assert v["train.eval_every"] == (0 if v["train.eval_interval"] else max(1, steps // 12))
    if "train.eval_interval" in planned and v["train.time_budget"]:
        assert (v["train.eval_interval"] is None) == ("train.eval_every" in user)  # the user's steps instead
    if "train.eval_interval" in planned and v["train.eval_interval"]:
        assert parse_duration(v["train.eval_interval"]) <= 0.09 * parse_duration(v["train.time_budget"])
    if "train.label_smoothing" in planned:
        assert v["train.label_smoothing"] == (0.0 if epochs < 20 else 0.1)
    if "data.auto_augment" in planned:
        assert (v["data.auto_augment"] == "trivialaugment") == (epochs >= 80)
    if "data.random_erasing" in planned:
        assert (v["data.random_erasing"] > 0) == (epochs >= 80)
    if "data.mixup_alpha" in planned:
        assert (v["data.mixup_alpha"] > 0) == (epochs >= 300)


def test_the_plan_chooses_from_what_was_measured_and_says_why():
    got, values = [], {**flatten(build_config("photos-auto").to_dict())}
    got += run_rules(HYMENOPTERA, values, 0)
    got += run_rules(HYMENOPTERA, values, 1)
    v = {k: value for k, value, _ in got}
    assert (v["model.img_size"], v["model.patch_size"], v["model.name"]) == (64, 8, "vit_compact_patch8_64")
    assert (v["model.global_pool"], v["model.pos_embed"], v["model.patch_drop_rate"]) == ("avg", "sincos2d", 0.5)
    assert v["model.attention"] == "math"  # on a CPU
    assert "data.crop_pct" not in v  # photos of many sizes: the preset's 0.875 center crop
    assert v["train.batch_size"] == 32 and v["optim.lr"] == pytest.approx(3.5e-4)
    assert v["train.time_budget"] == "15m" and v["train.eval_interval"] == "75s" and v["train.eval_every"] == 0
    # 15 minutes at 0.5 s a step, 11 evaluations of 153 images at 2 ms, the final one and 5 s kept back
    fit = int((900 - 12 * 153 * 0.002 - 5) / 0.5)
    assert v["train.total_steps"] == int(1.2 * fit) and v["optim.warmup_steps"] == round(fit / 20)
    assert "train.threads" not in v  # 2 threads measured faster than 1
    epochs = fit * 32 / 245  # ~230 epochs: the long-run augmentation, no Mixup yet
    assert (v["data.auto_augment"], v["data.random_erasing"], v["data.mixup_alpha"]) == ("trivialaugment", 0.25, 0.0)
    assert 200 < epochs < 300 and v["data.scale"] == (0.08, 1.0) and v["train.label_smoothing"] == 0.1
    why = {k: reason for k, _, reason in got}
    assert "53.9% vs 45.4%" in why["model.patch_drop_rate"] and "48.6% vs 35.3%" in why["model.global_pool"]
    assert "541 vs 350 img/s" in why["model.attention"]
    assert "train.default_budget=15m" in why["train.time_budget"] and "0.5 s a step" in why["train.total_steps"]
    assert all(len(reason) > 20 for reason in why.values())
    # a GPU keeps epochs: 224 px in 16-px patches, 100 epochs, evaluations in steps
    gpu = plan(dataclasses.replace(HYMENOPTERA, device="cuda"))
    assert (gpu["model.img_size"], gpu["model.patch_size"], gpu["model.name"]) == (224, 16, "vit_tiny_patch16_224")
    assert gpu["model.attention"] == "sdpa"  # the model's default: flash / memory-efficient kernels on a GPU
    assert gpu["train.time_budget"] is None and gpu["train.total_steps"] == 700 and gpu["train.eval_every"] == 58
    # a busy machine: one thread measured faster than two is planned, and the fit follows its speed
    busy = plan(dataclasses.replace(HYMENOPTERA, clock=dataclasses.replace(CLOCK, threads=1, step_s=0.8)))
    assert busy["train.threads"] == 1 and busy["train.total_steps"] < v["train.total_steps"]


def test_images_at_the_models_size_are_evaluated_whole():
    cifar = dataclasses.replace(HYMENOPTERA, images=50_000, classes=10, short_side=32, uniform=True,
                                eval_images=10_000, final_images=10_000)
    got = {k: (value, why) for k, value, why in run_rules(cifar, {**flatten(build_config("photos-auto").to_dict())}, 0)}
    assert got["model.img_size"][0] == 32 and got["data.crop_pct"][0] == 1.0
    assert "zoom the evaluated images 1.16x" in got["data.crop_pct"][1]  # round(32 / 0.875) = 37 px
    assert plan(cifar, **{"model.img_size": 48})["data.crop_pct"] == 0.875  # resized: the preset's crop
    assert plan(dataclasses.replace(cifar, uniform=False))["data.crop_pct"] == 0.875


def test_a_fine_tune_shorter_than_its_budget_evaluates_in_steps_over_its_own_length():
    source = ("vitflow run runs/photos", "vit_cifar_patch4_32", {"img_size": 32, "patch_size": 4})
    short = dataclasses.replace(HYMENOPTERA, source=source, clock=dataclasses.replace(CLOCK, step_s=0.18))
    v = plan(short)  # 30 epochs of 245 images at batch 32: 210 steps, ~38 s of a 15-minute budget
    assert v["train.total_steps"] == 210 and v["train.eval_interval"] is None
    assert v["train.eval_every"] == v["train.checkpoint_every"] == 210 // 12  # the first after ~8% of the run
    long = dataclasses.replace(short, images=20_000, clock=dataclasses.replace(CLOCK, step_s=0.5))
    v = plan(long)  # 5,000 steps at 0.5 s do not fit 15 minutes: evaluations in time, as from scratch
    assert v["train.eval_interval"] == "75s" and v["train.eval_every"] == 0 and v["train.total_steps"] < 5000


ALTERNATIVES = {  # a value the user might set for every key the plan sets
    "model.img_size": 96, "model.patch_size": 16, "model.name": "vit_tiny_patch16_224", "model.global_pool": "token",
    "model.pos_embed": "learned", "model.patch_drop_rate": 0.0, "model.attention": "sdpa", "data.crop_pct": 0.9,
    "train.batch_size": 64, "optim.lr": 1e-3,
    "optim.layer_decay": 0.8, "train.threads": 2, "train.time_budget": "5m", "train.eval_interval": "30s",
    "train.total_steps": 300, "optim.warmup_steps": 7, "train.eval_every": 50, "train.checkpoint_every": 100,
    "data.train_augment": "pad_crop", "data.scale": (0.5, 1.0), "train.label_smoothing": 0.2,
    "data.auto_augment": "randaugment", "data.random_erasing": 0.5, "data.mixup_alpha": 0.2, "data.cutmix_alpha": 0.5,
    "train.race": "none",
}


def test_every_planned_key_set_by_the_user_replans_what_depends_on_it():
    assert set(ALTERNATIVES) == {r.key for r in RULES}  # a new planned key needs its line here
    base = plan(HYMENOPTERA)
    consistent(HYMENOPTERA, base, set())
    for key, value in ALTERNATIVES.items():
        v = plan(HYMENOPTERA, **{key: value})
        assert v[key] == value, key
        consistent(HYMENOPTERA, v, {key})
    # the case: the user's 300 steps, and the warmup, evaluations and checkpoints follow them
    v = plan(HYMENOPTERA, **{"train.total_steps": 300})
    assert v["train.time_budget"] is None and v["optim.warmup_steps"] == 15
    assert v["train.eval_every"] == v["train.checkpoint_every"] == 25
    # another default budget, or none: the length follows
    assert plan(HYMENOPTERA, **{"train.default_budget": "5m"})["train.total_steps"] < base["train.total_steps"]
    assert plan(HYMENOPTERA, **{"train.default_budget": None})["train.total_steps"] == 700


def test_expectations_before_step_1_say_duration_first_evaluation_and_the_budget():
    profile = DataProfile(245, 2, 355, 500, False, 153, 0)
    lines = expectations(HYMENOPTERA, plan(HYMENOPTERA), profile)
    text = "\n".join(lines)
    assert "clock: 0.5 s a step at batch 32 (fp32, 2 threads" in text
    assert "expected duration: 15.0 min (" in text and "train.time_budget=15m" in text
    assert "first evaluation at step ~150 (~75 s in), then every 75s" in text
    assert "without a budget (100 epochs, 700 steps) it would take ~5.8 min" in text
    fixed = "\n".join(expectations(HYMENOPTERA, plan(HYMENOPTERA, **{"train.total_steps": 300}), profile))
    assert "expected duration: 2.6 min (300 steps" in fixed and "first evaluation at step ~25" in fixed
    assert f"train.time_budget=15m would give {int((900 - 153 * 0.002 - 5) / 0.5)} steps" in fixed


def test_a_named_swin_keeps_its_own_sizes_and_position_encoding(tmp_path: Path, monkeypatch):
    swin = plan(dataclasses.replace(HYMENOPTERA, family="swin"), **{"model.name": "swin_cifar_patch2_window4_32"})
    assert (swin["model.img_size"], swin["model.patch_size"], swin["model.pos_embed"]) == (None, None, "learned")
    # end to end on the CIFAR JPEG tar: the preset's ViT-only sin-cos positions are not handed to the Swin (its
    # section has no pos_embed), and the model is built with the variant's patch 2 (a 16 x 16 grid), not the plan's 4
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    cfg = planned_config(["model.name=swin_cifar_patch2_window4_32", f"data.path={need(CIFAR_TAR)}",
                          f"train.run_dir={tmp_path / 'run'}"], CONFIG_CHECKS)
    assert (cfg.model.img_size, cfg.model.patch_size, hasattr(cfg.model, "pos_embed")) == (None, None, False)
    model = create_model(**model_args(cfg.model, 10))
    assert tuple(model.patch_embed.proj.weight.shape) == (96, 3, 2, 2)


def test_the_clock_counts_augmentation_and_checkpoints_and_the_tier_follows_the_steps_that_run():
    honest = dataclasses.replace(CLOCK, augment_s={"light": 0.05, "strong": 0.45}, checkpoint_s=0.4)
    f = dataclasses.replace(HYMENOPTERA, clock=honest)
    v = plan(f)
    one = 153 * 0.002 + 0.4  # an evaluation and the checkpoint after it
    strong_fit = int((900 - 11 * one - one - 5) / 0.95)  # 11 periodic evaluations, the final one, 5 s kept back
    assert strong_fit * 32 / 245 >= 80  # ~290 epochs even at the strong tier's cost: TrivialAugment and erasing
    assert v["train.total_steps"] == int(1.2 * strong_fit) and v["data.auto_augment"] == "trivialaugment"
    # a step whose strong augmentation is costly: at its cost fewer than 80 epochs fit, at the light one more would;
    # the tier follows the steps that will run (before: the light step's epochs chose the strong tier)
    costly = dataclasses.replace(f, clock=dataclasses.replace(honest, augment_s={"light": 0.05, "strong": 1.9}))
    v = plan(costly)
    light_fit = int((900 - 12 * one - 5) / 0.55)
    assert int((900 - 12 * one - 5) / 2.4) * 32 / 245 < 80 <= light_fit * 32 / 245
    assert (v["data.auto_augment"], v["data.random_erasing"]) == ("none", 0.0)
    assert v["train.total_steps"] == int(1.2 * light_fit)
    # the user's policy is paid for in the fit
    assert plan(costly, **{"data.auto_augment": "trivialaugment"})["train.total_steps"] < v["train.total_steps"]
    lines = "\n".join(expectations(costly, v, DataProfile(245, 2, 355, 500, False, 153, 0)))
    assert "clock: 0.55 s a step at batch 32" in lines and "0.05 s of it the light device augmentation" in lines
    assert f"an evaluation of 153 images ~{one:.1f} s with its checkpoint (0.4 s)" in lines


def test_measure_clock_times_each_augmentation_tier_and_a_checkpoint(monkeypatch):
    cfg = build_config("photos-auto", overrides=[f"data.path={need(HYMENOPTERA_TAR)}", "model.pretrained=none",
                                                  "model.depth=2", "train.batch_size=16", "train.threads=1"],
                       model_config=config_class)
    tiers, augment_seconds = [], clock_module._augment_seconds
    monkeypatch.setattr(clock_module, "_augment_seconds", lambda *a: tiers.append(a[-1]) or augment_seconds(*a))
    c = clock_module.measure_clock(cfg.model, cfg.data, cfg.train, cfg.optim, 2)
    # each tier's own pipeline timed once (their ratio is the machine's load, not asserted here: benchmarks time)
    assert sorted(tiers) == ["light", "strong"] and set(c.augment_s) == {"light", "strong"}
    assert all(0 < s < c.step_s * 10 for s in c.augment_s.values()) and c.checkpoint_s > 0
    assert c.step_cost("strong") == c.step_s + c.augment_s["strong"]
    # a race's candidate: only its own steps and evaluation forward timed, at the plan's thread count, the rest the plan's
    mvit = build_config("photos-auto", overrides=[f"data.path={need(HYMENOPTERA_TAR)}", "model.pretrained=none",
                                                   "model.name=mvitv2_compact_64", "model.depths=1,1,1",
                                                   "train.batch_size=16"], model_config=config_class)
    timed, median_step = [], clock_module._median_step
    monkeypatch.setattr(clock_module, "_median_step", lambda *a: timed.append(a[2]) or median_step(*a))
    quick = clock_module.measure_clock(mvit.model, mvit.data, mvit.train, mvit.optim, 2, like=c)
    assert list(quick.by_threads) == [1] and quick.threads == 1 and quick.step_s > 0 and quick.eval_image_s > 0
    assert (quick.augment_s, quick.checkpoint_s, quick.decode_s) == (c.augment_s, c.checkpoint_s, c.decode_s)
    assert timed == [clock_module.QUICK_STEPS]  # one thread count, two timed steps


def test_a_named_model_keeps_its_geometry_and_the_plan_says_what_it_set_over_it(caplog, monkeypatch):
    v = plan(HYMENOPTERA, **{"model.name": "vit_small_patch16_224"})
    # the name's input size, patch size, pooling and positions: nothing planned over them
    assert (v["model.img_size"], v["model.patch_size"], v["model.global_pool"]) == (None, None, None)
    assert v["model.pos_embed"] == "learned" and v["model.name"] == "vit_small_patch16_224"
    # what the plan still sets (PatchDropout, the attention kernel, the length) follows the name's 224 px
    assert v["model.patch_drop_rate"] == 0.5 and v["model.attention"] == "sdpa"  # math: measured at ~65 tokens
    assert v["data.train_augment"] == "random_resized_crop" and v["train.total_steps"] > 0
    # the user's model.img_size is taken, in the name's own patches
    sized = plan(HYMENOPTERA, **{"model.name": "vit_small_patch16_224", "model.img_size": 96})
    assert (sized["model.img_size"], sized["model.patch_size"]) == (96, None)
    # a model named at the images' own size is evaluated whole, as an unnamed one would be
    cifar = dataclasses.replace(HYMENOPTERA, images=5000, classes=10, short_side=32, uniform=True)
    assert plan(cifar, **{"model.name": "vit_cifar_patch4_32"})["data.crop_pct"] == 1.0
    # end to end: the built config keeps ViT-S/16's geometry, and the log names what the plan set over it
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config(["model.name=vit_small_patch16_224", f"data.path={need(HYMENOPTERA_TAR)}",
                              "data.train_split=train", "data.val_split=val"], CONFIG_CHECKS)
    model = create_model(**model_args(cfg.model, 2))
    assert tuple(model.patch_embed.proj.weight.shape) == (384, 3, 16, 16) and model.pos_embed.shape[1] == 197
    text = caplog.text
    assert ("model.name=vit_small_patch16_224 is yours: its 224 px input in 16-px patches (196 tokens) kept" in text)
    assert "model.patch_drop_rate=0.5" in text and "[model.name=vit_small_patch16_224 alone: 0.0]" in text
    assert "model.attention=" not in text.split("resolved config")[0]
    assert "model.img_size=64" not in text and "model.patch_size=" not in text.split("resolved config")[0]


def test_is_planned_only_without_a_preset_or_config_and_with_a_path():
    assert is_planned(None, None, ["data.path=photos"]) and is_planned("photos-auto", None, [])
    assert is_planned(None, None, ["data.path=photos", "model.pretrained=runs/a"])  # a planned fine-tune
    assert not is_planned("cifar10-vit-tiny", None, ["data.path=photos"])
    assert not is_planned(None, "run.yaml", ["data.path=photos"]) and not is_planned(None, None, [])
    assert not is_planned(None, None, ["data.path=x", "data.source=digits"])


def test_size_warnings_name_the_tokens_and_the_upsampling():
    cfg = build_config(overrides=["model.img_size=224", "model.patch_size=4", "train.device=cpu"])
    warnings = size_warnings(cfg.model, cfg.train.device, DataProfile(100, 2, 64, 64))
    assert any("3136 tokens per image (224 px in 4-px patches) on a CPU" in w and "model.patch_size=28" in w
               for w in warnings)
    assert any("model.img_size=224 is over twice the images' median short side (64 px)" in w for w in warnings)
    assert size_warnings(build_config(overrides=["model.img_size=32", "model.patch_size=4"]).model, "auto",
                         DataProfile(100, 2, 32, 32)) == []
    # a Swin's window attention and an MViT's pooled keys grow about linearly with the tokens: no
    # patch-size advice, only the upsampling
    for name in ("swin_tiny_patch4_window7_224", "mvitv2_tiny"):
        cfg = build_config(overrides=[f"model.name={name}", "train.device=cpu"], model_config=config_class)
        assert [w.split(":")[0] for w in size_warnings(cfg.model, "cpu", DataProfile(100, 2, 64, 64))] == [
            "model.img_size=224 is over twice the images' median short side (64 px)"], name


@pytest.mark.slow
def test_hymenoptera_planned_measures_the_clock_and_ends_within_its_budget(tmp_path: Path, caplog):
    """The real clock: a few steps of the planned model before step 1, the expectations logged, a
    20-second budget kept, and evaluations spaced in time (the first within ~10% of the run)."""
    path = need(HYMENOPTERA_TAR)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([f"data.path={path}", f"train.run_dir={tmp_path / 'run'}", "train.default_budget=20s",
                              "train.log_every=2"], CONFIG_CHECKS)
        summary = train(cfg)
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan: 245 training images of 2 classes" in log and "plan: model.name=vit_compact_patch8_64" in log
    assert "plan: clock: " in log and "plan: expected duration: 20 s (" in log and "first evaluation at step ~" in log
    assert "train.default_budget=20s" in log and cfg.train.time_budget == "20s"
    assert log.index("plan: expected duration") < log.index("input pipeline:")  # before the run is even built
    assert "train: caching at 73x73 (photos of" in log
    assert "input pipeline: batched in-RAM gather + device random-resized-crop/flip" in log
    assert summary["elapsed_s"] <= 20 * 1.15 and 0 <= summary["val_top1"] <= 1 and "test_top1" not in summary
    assert "val_top5" not in summary  # 2 classes: top-5 means nothing
    evals = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in r]
    assert evals[0]["step"] < summary["step"] == evals[-1]["step"]  # timed evaluations before the final one


def test_a_run_of_this_plan_on_this_data_is_continued_not_fine_tuned(tmp_path: Path, caplog, monkeypatch):
    """``model.pretrained=RUN`` where RUN is a from-scratch run of the plan on the same data (train ->
    inspect -> train data.exclude=...) carries it on with the from-scratch recipe in its own
    architecture; the same weights on other data are a backbone to fine-tune."""
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    data = [f"data.path={need(HYMENOPTERA_TAR)}", "data.train_split=train", "data.val_split=val"]
    first = tmp_path / "first"
    train(planned_config([*data, f"train.run_dir={first}", "train.total_steps=2", "train.race=none"], CONFIG_CHECKS))
    with caplog.at_level(logging.INFO, logger="vitflow"):
        cfg = planned_config([data[0], f"model.pretrained={first}", "train.time_budget=60s",
                              f"train.run_dir={tmp_path / 'second'}"], CONFIG_CHECKS)
    assert f"model.pretrained={first} is a from-scratch run of this plan on this data" in caplog.text
    assert cfg.preset == "photos-auto" and cfg.optim.layer_decay is None
    assert cfg.optim.lr == pytest.approx(7e-4 * math.sqrt(cfg.train.batch_size / 128), rel=0.03)
    assert (cfg.model.name, cfg.model.img_size, cfg.model.patch_size) == ("vit_compact_patch8_64", 64, 8)
    assert (cfg.data.train_split, cfg.data.val_split) == ("train", "val")  # the run's split (not val_split=auto)
    cfg.train.total_steps, cfg.train.time_budget = 2, None
    assert train(cfg)["step"] == 2  # the first run's weights load into the architecture kept
    other = hymenoptera_subset(tmp_path / "other")  # the same classes, another folder: a fine-tune
    tuned = planned_config([f"data.path={other}", f"model.pretrained={first}", "train.time_budget=60s"], CONFIG_CHECKS)
    assert tuned.preset == "finetune" and tuned.optim.layer_decay == 0.75


def test_a_fine_tune_of_an_mvitv2_run_plans_no_vit_keys(tmp_path: Path, monkeypatch, caplog):
    """The source's family decides the fine-tune's keys: an MViTv2 run's weights on other data get no
    PatchDropout (a ViT key MViTv2 refuses), as a ViT source gets 0."""
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    data = [f"data.path={need(HYMENOPTERA_TAR)}", "data.train_split=train", "data.val_split=val"]
    first = tmp_path / "first"
    train(planned_config([*data, "model.name=mvitv2_compact_64", "model.depths=[1, 1, 1]", f"train.run_dir={first}",
                          "train.total_steps=2", "train.race=none"], CONFIG_CHECKS))
    other = hymenoptera_subset(tmp_path / "other")
    with caplog.at_level(logging.INFO, logger="vitflow"):  # it raised "model.patch_drop_rate is not a key of MViTv2"
        tuned = planned_config([f"data.path={other}", f"model.pretrained={first}", "train.time_budget=60s"],
                               CONFIG_CHECKS)
    assert tuned.preset == "finetune" and tuned.optim.layer_decay == 0.75
    assert "the architecture of" in caplog.text and "mvitv2_compact_64" in caplog.text
    assert "model.patch_drop_rate" not in caplog.text


@pytest.fixture(scope="module")
def imagenet_csv(tmp_path_factory) -> Path:
    """The ImageNet sample's first 320 photos (sorted by WordNet id) re-labelled into four classes
    by position (quarters of the sorted ids: mostly fish/birds, reptiles/..., dogs, ...), every
    fifth one held out as ``val``: a label file of real photos of many sizes."""
    root = tmp_path_factory.mktemp("imagenet")
    with tarfile.open(need(IMAGENET_TAR)) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name)[:320]
        tf.extractall(root, members=members, filter="data")
    rows = [{"path": m.name, "label": f"group{i * 4 // len(members)}", "split": "val" if i % 5 == 4 else "train"}
            for i, m in enumerate(members)]
    return write_csv(root / "labels.csv", rows)


def test_imagenet_sample_relabelled_trains_planned_from_a_label_file(imagenet_csv: Path, tmp_path: Path, caplog,
                                                                     monkeypatch):
    monkeypatch.setattr("vitflow.training.plan.recipe.measure_clock", lambda *a: CLOCK)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        summary = train(planned_config([f"data.path={imagenet_csv}", f"train.run_dir={tmp_path / 'run'}", *SHORT],
                                       CONFIG_CHECKS))
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "plan: 256 training images of 4 classes" in log and "plan: train.batch_size=64" in log
    assert "plan: train.time_budget=15m  (" not in log  # the user's steps: no budget fitted
    assert "input pipeline: batched in-RAM gather + device random-resized-crop/flip" in log
    assert summary["step"] == 3 and 0 <= summary["val_top1"] <= 1


def test_long_runs_augment_on_the_batched_path(imagenet_csv: Path, tmp_path: Path, caplog):
    with caplog.at_level(logging.INFO, logger="vitflow"):
        train(build_config("photos-auto", overrides=[
            f"data.path={imagenet_csv}", f"train.run_dir={tmp_path / 'run'}", "train.total_steps=2",
            "data.auto_augment=trivialaugment", "data.random_erasing=0.25", "train.batch_size=32"]))
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "input pipeline: batched in-RAM gather + device random-resized-crop/flip + trivialaugment + random " \
           "erasing 0.25, 0 worker(s)" in log


def test_cache_resolution_full_keeps_photos_on_the_per_image_path(tmp_path: Path, caplog, monkeypatch):
    monkeypatch.setattr(clock_module, "MAX_PROBE_SECONDS", 1.0)
    path = need(HYMENOPTERA_TAR)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        train(planned_config([f"data.path={path}", f"train.run_dir={tmp_path / 'run'}", "data.cache_resolution=full",
                              "train.total_steps=1", "data.num_workers=0"], CONFIG_CHECKS))
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "caching at" not in log and "input pipeline: per-image decode/augment" in log
