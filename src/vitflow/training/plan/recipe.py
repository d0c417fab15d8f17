"""A training recipe planned from the data, the machine and its clock, for ``vitflow train
data.path=PHOTOS`` with no preset (or ``--preset photos-auto``), and a fine-tune of
``model.pretrained=SOURCE`` (a run folder, a vitflow checkpoint or hub folder, any weights with
a config) the same way.

:func:`profile_data` looks at the data (image count, classes, the typical size from the headers of
a sample, the held-out images; slices of train where the data has no validation split:
:mod:`vitflow.training.plan.holdout`); the rules of :mod:`vitflow.training.plan.rules` choose the model and
the batch; :func:`vitflow.training.plan.clock.measure_clock` times a few real steps of that model on this
machine; the rules then choose the length (on a CPU, fitted to ``train.time_budget`` or
``train.default_budget``), the warmup, the evaluations (spaced in time) and the augmentation
strength for that length. Every choice is logged with its reason, then what the run will take:
its expected duration, when its first evaluation comes, and what a time budget would give —
before step 1. The user's ``key=value`` overrides always win, and the keys that depend on them
follow them. :func:`size_warnings` warns, for any run, when the tokens per image or the input size
are far above what the images hold.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import numpy as np

from vitflow.config import Config, DataConfig, ModelConfig, build_config, field_names, parse_duration, to_yaml
from vitflow.config.build import flatten
from vitflow.config.messages import MESSAGES
from vitflow.data import DataError
from vitflow.data.remote.fs import configure_from as configure_remote
from vitflow.data.sources.dispatch import find_eval_splits, open_split, open_training
from vitflow.data.sources.table import reads_path
from vitflow.models import MODELS, config_class, family_of, model_kwargs
from vitflow.models.pretrained.backbones import BACKBONES, choose_backbone
from vitflow.models.pretrained.config import apply_pretrained
from vitflow.models.pretrained.hub import resolve_pretrained
from vitflow.runtime import resolve_device
from vitflow.training.plan.clock import Clock, measure_clock
from vitflow.training.plan.continuation import continued_run
from vitflow.training.plan.facts import DataProfile, Facts
from vitflow.training.plan.holdout import hold_out
from vitflow.training.plan.rules import (
    augment_tier,
    budget_steps,
    epochs_steps,
    evaluation_s,
    expected_steps,
    planned_epochs,
    run_rules,
)

log = logging.getLogger(__name__)

PHOTO_PRESET = "photos-auto"
FINETUNE_PRESET = "finetune"
SAMPLE = 64  # images whose headers give the typical size


def profile_data(d: DataConfig) -> DataProfile:
    """Open the training split of the data section ``d`` and read the sizes of up to :data:`SAMPLE` images
    spread over it (from the encoded headers; decoded sources give their fixed size), and count the
    held-out splits' images. A shard set is not read whole: its counts come from the index and the
    sizes from its first shard.

    Raises:
        DataError: see :func:`vitflow.data.open_split`; no readable image in the sample.
    """
    configure_remote(d)  # the run's retries, backoff and cache apply to the plan's reads too
    src = open_training(d)  # shards: streamed, the index's counts, the first shard's sizes
    profile = _profile(d.path, len(src), len(src.classes), src.sample_sizes(SAMPLE))
    val, test = find_eval_splits(d)  # neither: the plan holds both out of train (plan.holdout)
    counts = [len(open_split(d.path, s, d.source, classes=src.classes, cfg=d)) if s else 0 for s in (val, test)]
    return dataclasses.replace(profile, val_images=counts[0], test_images=counts[1])


def _profile(path: str, images: int, classes: int, sizes: list[tuple[int, int]]) -> DataProfile:
    if not sizes:
        raise DataError(f"{path}: no readable image among the {min(SAMPLE, images)} sampled")
    short, long = np.median([min(s) for s in sizes]), np.median([max(s) for s in sizes])
    return DataProfile(images, classes, int(short), int(long), len(set(sizes)) == 1)


def size_warnings(m: ModelConfig, device: str, profile: DataProfile) -> list[str]:
    """Warnings when the input is far above what the images hold: over 256 tokens per image on a
    CPU for a model with global attention (a Swin attends within fixed windows, an MViT to keys
    pooled over the grid: their cost grows about linearly with the tokens), or an input size over twice the images' median short side
    (upsampled pixels carry no detail, and cost ``(size / patch)^2`` tokens). None for
    ``model.name=auto`` (the weights' architecture is known only once they are read). ``m``: the
    model section; ``device``: ``train.device``."""
    if m.name == "auto":
        return []
    out, defaults = [], model_kwargs(m.name)
    image, patch_size = m.img_size or defaults["img_size"], m.patch_size or defaults["patch_size"]
    tokens = (image // patch_size) ** 2
    windowed = family_of(m.name).name in ("swin", "mvit")
    if tokens > 256 and not windowed and not device.startswith("cuda"):
        better = max(patch_size, image // 8)
        out.append(f"{tokens} tokens per image ({image} px in {patch_size}-px patches) on a CPU: attention cost grows "
                   f"with the square of the tokens; model.patch_size={better} would give {(image // better) ** 2}")
    if image > 2 * profile.short_side:
        out.append(f"model.img_size={image} is over twice the images' median short side ({profile.short_side} px): "
                   "upsampled pixels add tokens, not detail")
    return out


def _source(m: ModelConfig) -> tuple[str, str | None, dict] | None:
    """``(origin, model name, model kwargs)`` of ``model.pretrained`` (what a fine-tune takes), or
    ``None`` without one; bare weights name no architecture (the name is then the user's, or none:
    ``model.name=auto`` then says to set it)."""
    if not m.pretrained:
        return None
    pre = resolve_pretrained(m.pretrained)
    if not pre.model_name:
        return f"the weights {m.pretrained}", None if m.name == "auto" else m.name, {}
    kwargs = {**pre.model_kwargs, **({"img_size": pre.preprocess["input_size"]} if "input_size" in (
        pre.preprocess or {}) else {})}
    return pre.origin or f"the config of {m.pretrained}", pre.model_name, kwargs


def make_facts(m: ModelConfig, device: str, profile: DataProfile, user: set[str], continues: bool = False) -> Facts:
    """The :class:`~vitflow.training.plan.rules.Facts` of a run of model ``m`` on ``device``
    (``train.device``) on data ``profile``; ``user``: the keys the user set; ``continues``: ``m``'s
    ``model.pretrained`` is a from-scratch run of this data carried on, not a fine-tune's source
    (:func:`~vitflow.training.plan.continuation.continued_run`)."""
    source = None if continues else _source(m)
    name = source[1] if source else m.name  # a fine-tune: the source's architecture (an MViTv2 run has no PatchDropout)
    family = "vit" if name in (None, "auto") or (source and name not in MODELS) else family_of(name).name
    monitored = profile.val_images or profile.test_images
    named = m.name if "model.name" in user and m.name != "auto" and not source else None
    return Facts(profile.images, profile.classes, profile.short_side, profile.uniform,
                 resolve_device(device).type, family, source, eval_images=monitored,
                 final_images=profile.val_images + profile.test_images, val_images=profile.val_images,
                 user=frozenset(user), named=named)


def _measure(preset: str, planned: list, overrides: list[str], checks, classes: int,
             like: Clock | None = None) -> Clock | None:
    """The clock of the phase-0 plan's model (``None`` under torchrun: every rank must plan alike)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.info("plan: under torchrun the length is planned in epochs (the ranks must agree on a schedule)")
        return None
    cfg = build_config(preset, overrides=[f"{k}={v}" for k, v, _ in planned] + overrides, checks=checks,
                       model_config=config_class)
    # model.name=auto: the source's architecture (its weights are not needed to time it)
    cfg.model, _ = apply_pretrained(cfg.model, cfg.data, getattr(cfg, "key_origins", None))
    cfg.model.pretrained = None
    return measure_clock(cfg.model, cfg.data, cfg.train, cfg.optim, classes, like)


def planned_config(overrides: list[str], checks, preset: str | None = None, like: Clock | None = None) -> Config:
    """The config of ``vitflow train data.path=PHOTOS``: ``preset`` (the fixed part of the recipe:
    :data:`PHOTO_PRESET`, or :data:`FINETUNE_PRESET` for a ``model.pretrained`` source), then the
    planned values (each logged with its reason; the step time measured between the model and the
    length), then ``overrides``, which always win. Logs the run's expected duration, its first
    evaluation and the size warnings of :func:`size_warnings`. ``like``: the clock of another
    model on this data (see :func:`~vitflow.training.plan.clock.measure_clock`).

    Raises:
        ConfigError, DataError: as :func:`vitflow.config.build_config` and :func:`profile_data`.
        FileNotFoundError, ValueError: an unreadable ``model.pretrained``.
    """
    user = {o.split("=", 1)[0].strip() for o in overrides}
    overrides = with_backbone(overrides, preset)
    source = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "model.pretrained"]
    chosen = preset or (FINETUNE_PRESET if source and source[-1].lower() not in ("none", "null", "") else PHOTO_PRESET)
    base = build_config(chosen, overrides=overrides, checks=checks, model_config=config_class)
    kept = continued_run(base.model, base.data, PHOTO_PRESET) if chosen == FINETUNE_PRESET and not preset else None
    architecture = [f"{k}={_shown(v)}" for k, v in kept.items()] if kept is not None else None
    if architecture is not None:  # carried on with its own recipe, in its own architecture
        log.info("plan: model.pretrained=%s is a from-scratch run of this plan on this data: it is continued with the "
                 "from-scratch recipe planned for this run (not a backbone's fine-tune), in its architecture and on its split: %s",
                 base.model.pretrained, " ".join(architecture))
        overrides = architecture + overrides  # the user's own keys still win
        user |= {o.split("=", 1)[0] for o in architecture}
        chosen = PHOTO_PRESET
        base = build_config(chosen, overrides=overrides, checks=checks, model_config=config_class)
    preset = chosen
    profile = profile_data(base.data)
    log.info("plan: %d training images of %d classes, median %dx%d px; %d validation and %d test images",
             profile.images, profile.classes, profile.long_side, profile.short_side, profile.val_images,
             profile.test_images)
    held_out, profile = hold_out(profile, base.data, user)
    facts = make_facts(base.model, base.train.device, profile, user, continues=architecture is not None)
    values = flatten(base.to_dict())
    values.update({k: v for k, v, _ in held_out})
    planned = held_out + _family_keys(run_rules(facts, values, 0), base.model)
    clock = _measure(preset, planned, overrides, checks, profile.classes, like)
    facts = dataclasses.replace(facts, clock=clock)
    planned += _family_keys(run_rules(facts, values, 1), base.model)
    if facts.named and architecture is None:  # (a continued run's architecture is said above)
        log.info("plan: %s", named_geometry(facts.named, base.model))
    for key, value, why in planned:
        log.info("plan: %s=%s  (%s)%s", key, _shown(value), why, against_named(facts.named, key, value))
    cfg = build_config(preset, overrides=[f"{k}={_shown(v)}" for k, v, _ in planned] + overrides, checks=checks,
                       model_config=config_class)
    for line in expectations(facts, values, profile):
        log.info("plan: %s", line)
    cfg.planned_step_s = planned_step_s(facts, values)  # the race records its candidates' (benchmarks/plan_suite.py)
    for warning in size_warnings(cfg.model, cfg.train.device, profile):
        log.warning("%s", warning)
    log.info("resolved config (save it and pass --config FILE to repeat the run):\n%s", to_yaml(cfg).rstrip())
    if cfg.train.race != "none":  # each other candidate is planned when the race starts (its steps timed then)
        threads = [f"train.threads={cfg.train.threads}"] if cfg.train.threads and "train.threads" not in user else []
        # the other families' attention backends timed per shape (the plan's math rule was measured on the ViT
        # only; auto's timing runs in the clock's untimed step): 5% more MViTv2 img/s than sdpa in fp32 on avx2
        attention = [] if "model.attention" in user else ["model.attention=auto"]
        cfg.plan_candidate = functools.partial(plan_candidate, overrides + threads + attention, checks, preset,
                                               clock)  # type: ignore
    return cfg


def plan_candidate(overrides: list[str], checks, preset: str | None, like: Clock | None, name: str) -> Config:
    """The planned config of the race's candidate model ``name``: :func:`planned_config` of the
    run's ``overrides`` (the backbone already resolved, the plan's thread count) with
    ``model.name=name`` and no race of its own, its steps timed on a clock ``like`` the plan's
    model's; its lines quiet (warnings still said).

    Raises:
        as :func:`planned_config`.
    """
    quiet = logging.getLogger("vitflow.training.plan")
    level = quiet.level
    quiet.setLevel(max(logging.WARNING, quiet.getEffectiveLevel()))
    try:
        return planned_config([*overrides, f"model.name={name}", "train.race=none"], checks, preset, like)
    finally:
        quiet.setLevel(level)


def named_geometry(name: str, m: ModelConfig) -> str:
    """The line saying what the model the user named keeps: its input and patch size (the user's
    ``model.img_size`` / ``model.patch_size`` where set) and its tokens per image."""
    own = model_kwargs(name)
    size, patch = m.img_size or own.get("img_size"), m.patch_size or own.get("patch_size")
    if not size or not patch:
        return f"model.name={name} is yours: its architecture is kept"
    whose = "its" if m.img_size is None else "your model.img_size's"
    return (f"model.name={name} is yours: {whose} {size} px input in {patch}-px patches ({(size // patch) ** 2} "
            "tokens) kept; set model.img_size / model.patch_size to change them")


def against_named(name: str | None, key: str, value) -> str:
    """For a model key the plan set over the model the user named, what the name alone gives
    (``""`` otherwise, or when they agree)."""
    if not name or not key.startswith("model."):
        return ""
    leaf, own = key[len("model."):], model_kwargs(name)
    fields = {f.name: f.default for f in dataclasses.fields(config_class(name))}
    if leaf not in own and leaf not in fields:
        return ""
    alone = own.get(leaf, fields.get(leaf))
    return "" if alone == value else f"  [model.name={name} alone: {_shown(alone)}]"


def with_backbone(overrides: list[str], preset: str | None) -> list[str]:
    """``overrides`` with ``model.pretrained=auto`` (the user's, or the photo preset's default)
    replaced by the backbone :func:`~vitflow.models.pretrained.backbones.choose_backbone` finds
    (``hf-hub:REPO@COMMIT``, logged with how it was had) or by ``none`` after the one line saying
    why and how to get one. Other values are left as they are."""
    keys = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides if "=" in o}
    value = keys.get("model.pretrained", "auto" if preset in (None, PHOTO_PRESET) else None)
    if value != "auto":
        return overrides
    named = keys.get("model.name")
    rest = [o for o in overrides if o.split("=", 1)[0].strip() != "model.pretrained"]
    spec, backbone, how = choose_backbone(resolve_device(keys.get("train.device", "auto")).type,
                                          named if named not in (None, "auto") else None)
    if backbone is None:
        log.warning("%s", MESSAGES["no_backbone"].format(why=how, hub=BACKBONES[0].hub))
        return rest + ["model.pretrained=none"]
    log.info("plan: model.pretrained=%s  (a pretrained backbone: %s; %s)", spec, backbone.what, how)
    return rest + [f"model.pretrained={spec}"]


def _family_keys(planned: list, m: ModelConfig) -> list:
    """The planned values but the model keys the family of the user's ``model.name`` does not take
    (a Swin has no ``pos_embed``, no PatchDropout)."""
    if m.name == "auto":
        return planned
    keys = field_names(config_class(m.name))
    return [p for p in planned if not p[0].startswith("model.") or p[0][6:] in keys]


def _shown(value) -> str:
    """A value as a ``key=value`` override reads it back (tuples as ``[a, b]``; ``none`` for None)."""
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return "none" if value is None else str(value)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def expected_seconds(f: Facts, v: dict) -> float:
    """The planned run's duration in seconds from the clock ``f.clock`` (not ``None``): its expected
    steps, its evaluations and their checkpoints, the final evaluation; the budget where it ends
    the run first."""
    c, steps, budget = f.clock, expected_steps(f, v), v["train.time_budget"]
    if budget and budget_steps(f, v) < v["train.total_steps"]:
        return parse_duration(budget)  # the budget ends the run
    step_s = c.step_cost(augment_tier(f, v))
    interval = parse_duration(v["train.eval_interval"]) if v.get("train.eval_interval") else None
    every = v["train.eval_every"]
    evals = int(steps * step_s / interval) if interval else (steps - 1) // every if every else 0
    return steps * step_s + evals * evaluation_s(f) + f.final_images * c.eval_image_s + c.checkpoint_s


def planned_step_s(f: Facts, v: dict) -> float | None:
    """The planned seconds a step, all costs in (:func:`expected_seconds` over the expected steps);
    ``None`` without a clock."""
    return round(expected_seconds(f, v) / max(1, expected_steps(f, v)), 4) if f.clock is not None else None


def expectations(f: Facts, v: dict, profile: DataProfile) -> list[str]:
    """What the planned run will take, from the measured clock: its duration, when its first
    evaluation comes, the start-up before step 1, and what ``train.time_budget`` would give (or
    without a clock, a line saying so)."""
    c, batch = f.clock, v["train.batch_size"]
    if c is None:
        return [f"train.total_steps={v['train.total_steps']} (~{planned_epochs(f, v):.1f} epochs); the step time was "
                "not measured"]
    steps, eval_s, budget, tier = expected_steps(f, v), evaluation_s(f), v["train.time_budget"], augment_tier(f, v)
    step_s, seconds = c.step_cost(tier), expected_seconds(f, v)
    interval = parse_duration(v["train.eval_interval"]) if v.get("train.eval_interval") else None
    every = v["train.eval_every"]
    first_s = interval or (every * step_s if every else seconds)
    first_step = int(interval / step_s) if interval else (every or steps)
    decoded = profile.images + profile.val_images + profile.test_images
    startup = decoded * c.decode_s / max(1, os.cpu_count() or 1)
    extra = step_s - c.step_s
    lines = [f"clock: {step_s:.3g} s a step at batch {batch} ({c.precision}, {c.threads} thread"
             f"{'s' if c.threads > 1 else ''}: the planned model on this machine now, measured in {c.probe_s:.0f} s"
             + (f"; {extra:.2g} s of it the {tier} device augmentation" if extra > 0 else "") + "); "
             f"an evaluation of {f.eval_images} images ~{eval_s:.1f} s"
             + (f" with its checkpoint ({c.checkpoint_s:.2g} s)" if c.checkpoint_s else ""),
             f"expected duration: {_minutes(seconds)} ({steps} steps, ~{planned_epochs(f, v):.1f} epochs"
             + (f", train.time_budget={budget}" if budget else "") + f"), after ~{_minutes(startup)} of start-up "
             f"(decoding {decoded} images into RAM)",
             f"first evaluation at step ~{first_step} (~{_minutes(first_s)} in), then "
             + (f"every {v['train.eval_interval']}" if interval else f"every {every} steps" if every else
                "none before the end")]
    if budget:
        epochs, all_steps = epochs_steps(f, batch)
        return lines + [f"without a budget ({epochs} epochs, {all_steps} steps) it would take "
                        f"~{_minutes(all_steps * step_s)}"]
    for text in ("15m", "1h"):
        fitted = budget_steps(f, {**v, "train.time_budget": text, "train.eval_interval": None})
        lines.append(f"train.time_budget={text} would give {fitted} steps (~{fitted * batch / max(f.images, 1):.1f} "
                     "epochs)")
    return lines


def is_planned(preset: str | None, config_file: str | None, overrides: list[str]) -> bool:
    """Whether ``vitflow train`` plans the run: ``--preset photos-auto``, or no preset and no
    config file with a ``data.path`` (and not built-in data such as the embedded digits); with a
    ``model.pretrained`` too, the plan is a fine-tune's."""
    if preset == PHOTO_PRESET:
        return True
    keys = {o.split("=", 1)[0].strip(): o.split("=", 1)[1] for o in overrides if "=" in o}
    return not preset and not config_file and "data.path" in keys and reads_path(keys.get("data.source", "auto"))
