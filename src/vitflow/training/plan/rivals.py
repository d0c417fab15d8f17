"""What a planned run races (:mod:`vitflow.training.race`): the model families tried against the
plan's model at the same input size and token grid (:data:`RIVALS`), successive halving's rungs
(:func:`halving`), each rung's training time within the budget (:func:`rung_seconds`), and the
plan's rule for ``train.race`` (:func:`race_choice`)."""

from __future__ import annotations

import math

from vitflow.config import parse_duration
from vitflow.training.plan.facts import Facts, Values

RACE_SHARE = 0.2  # the most of train.time_budget the race spends training the candidates that lose
# the least training time a candidate gets in a rung: 60 s, a race from 15-minute budgets. In 5-minute runs (20-s
# rungs, benchmarks/plan_suite.py, 2026-12-06, avx2) the first rung's top-1 was near chance on 10-class folders
# and the race's cost (the losers' 20% and ~7 s a rung of start-up and scoring: a third of the budget) took 6
# points off eurosat_rgb, where the plan's ViT won anyway
MIN_RUNG_S = 60.0
RIVALS = {  # the plan's model -> the families raced against it, at the same input size and token grid
    "vit_compact_patch8_64": ("mvitv2_compact_64", "swin_compact_patch4_window4_64"),
    "vit_cifar_patch4_32": ("mvitv2_cifar_32", "swin_cifar_patch2_window4_32"),
}


def halving(n: int) -> list[int]:
    """The candidates trained in each rung of successive halving from ``n`` (Jamieson & Talwalkar
    2016): ``n``, then half of them (rounded up), until two are left: ``[3, 2]``, ``[4, 2]``, ``[2]``."""
    counts = [n]
    while counts[-1] > 2:
        counts.append(math.ceil(counts[-1] / 2))
    return counts


def rung_seconds(budget_s: float, n: int) -> float:
    """Training seconds per candidate per rung when ``n`` candidates race inside ``budget_s``:
    the losers' time, ``(sum(halving(n)) - rungs) x rung``, is :data:`RACE_SHARE` of the budget
    (the winner's own rungs are kept: it continues from its weights)."""
    counts = halving(n)
    return RACE_SHARE * budget_s / max(1, sum(counts) - len(counts))


def race_choice(f: Facts, v: Values) -> tuple[str, str] | None:
    """The plan's rule for ``train.race``: ``(value, why)``, or ``None`` where the key is not the plan's."""
    rivals, budget = RIVALS.get(v["model.name"]), v["train.time_budget"]
    if rivals is None or not f.plans_architecture or f.clock is None or v["data.task"] != "multiclass":
        return None
    if not budget:
        return "none", "no train.time_budget: no race (it runs inside a budget)"
    if not f.val_images:
        return "none", "no validation split to judge a race on (the test split chooses nothing)"
    names = (v["model.name"], *rivals)
    rung = rung_seconds(parse_duration(budget), len(names))
    if rung < MIN_RUNG_S:
        return "none", (f"train.time_budget={budget} would give each of {len(names)} candidates {rung:.0f} s a rung, "
                        f"under {MIN_RUNG_S:.0f} s: no race")
    return ",".join(names), (
        f"{len(names)} model families (the compact ViT, MViTv2, Swin at the same token grid) each planned and trained "
        f"{rung:.0f} s a rung on this data, halved by validation top-1 (successive halving, Jamieson & Talwalkar "
        f"2016; the 32-px MViTv2 reached 75.3% vs the ViT's 69.7% in 15-minute CIFAR-10 runs): at most "
        f"{RACE_SHARE:.0%} of the budget on the losers, the winner continued from its weights")
