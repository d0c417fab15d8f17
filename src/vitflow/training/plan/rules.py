"""The rules of a planned run: one :class:`Rule` per key the plan sets, each reading what it
depends on from the run's values as they stand (the user's keys, the preset's, and the values the
rules before it planned), so that a key the user sets re-plans every key that depends on it.

Two phases: phase 0 chooses the model and the batch (what the step time depends on); the plan
then measures the step time (:func:`vitflow.training.plan.clock.measure_clock`); phase 1 chooses the
length (a time budget, the steps, the warmup, the evaluations) and what depends on the length
(augmentation strength, label smoothing). Every choice carries its reason: a figure one of
vitflow's benchmarks measured (docs/guides/benchmarks.md) or the paper the setting comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from vitflow.config import parse_duration
from vitflow.data.cache import photo_cache_size
from vitflow.training.plan.clock import EVALUATIONS, evaluation_count, fit_steps
from vitflow.training.plan.facts import Facts, Values, input_size
from vitflow.training.plan.rivals import race_choice

Choice = tuple[Any, str] | None  # (value, why), or None: the rule leaves the key alone


@dataclass(frozen=True)
class Rule:
    """How the plan sets ``key``: ``choose(facts, values)`` from the values of ``needs`` (and the
    facts); ``phase`` 0 before the clock is measured, 1 after."""

    key: str
    needs: tuple[str, ...]
    choose: Callable[[Facts, Values], Choice]
    phase: int = 0


def _pow2_at_most(x: float) -> int:
    return 2 ** max(0, int(math.floor(math.log2(max(x, 1)))))


# --- phase 0: the model and the batch ---------------------------------------------------------------------

def _img_size(f: Facts, v: Values) -> Choice:
    native = f.short_side
    if not f.plans_architecture:
        return None
    if f.gpu:
        return 224, f"GPU: 224 px in 16-px patches (196 tokens); the images' median short side is {native} px"
    if native < 48:
        return 32, f"small images (median short side {native} px): 32 px in 4-px patches, 64 tokens"
    return 64, (f"CPU: 64 px in 8-px patches keeps 64 tokens per image (attention cost grows with the square of the "
                f"tokens); the images' median short side is {native} px")


def _patch_size(f: Facts, v: Values) -> Choice:
    if not f.plans_architecture:
        return None
    size = v["model.img_size"]
    patch = 16 if f.gpu else next(p for p in range(max(1, size // 8), 0, -1) if size % p == 0)
    grid = size // patch
    return patch, f"a {grid} x {grid} grid ({grid * grid} tokens) at model.img_size={size}"


def _model_name(f: Facts, v: Values) -> Choice:
    if f.source is not None:
        origin, name, kw = f.source
        if name is None:
            return None  # bare weights and no model.name: model.name=auto asks for one
        shown = ", ".join(f"{k}={kw[k]}" for k in ("img_size", "patch_size", "pos_embed", "global_pool") if k in kw)
        return "auto", f"fine-tune: the architecture of {origin}: {name}" + (f" ({shown})" if shown else "")
    if f.family != "vit":
        return None
    size, patch = v["model.img_size"], v["model.patch_size"]
    if f.gpu:
        small = f.images >= 20_000
        return (f"vit_{'small' if small else 'tiny'}_patch16_224",
                f"{f.images} images: ViT-{'Small' if small else 'Tiny'} (DeiT's widths){_at(size, patch, 224, 16)}")
    name, (own_size, own_patch) = (("vit_cifar_patch4_32", (32, 4)) if (size, patch) == (32, 4)
                                   else ("vit_compact_patch8_64", (64, 8)))
    return name, ("the compact ViT (dim 192, 9 blocks, MLP ratio 2) of vitflow's CPU benchmarks: ~1.9x the images/s "
                  f"of ViT-Tiny's 12 blocks{_at(size, patch, own_size, own_patch)}")


def _at(size: int, patch: int, own_size: int, own_patch: int) -> str:
    return "" if (size, patch) == (own_size, own_patch) else f", at {size} px in {patch}-px patches"


def _global_pool(f: Facts, v: Values) -> Choice:
    if not f.plans_architecture:
        return None
    return "avg", ("the mean of the patch tokens: with sin-cos positions 48.6% vs 35.3% for a class token with "
                   "learned positions in 5-minute CIFAR-10 runs (benchmarks guide; Beyer et al. 2022)")


def _pos_embed(f: Facts, v: Values) -> Choice:
    if f.source is not None or f.named:
        return None
    if f.family != "vit":
        return "learned", f"a {f.family} model: its own position encoding, input size and patch size"
    return "sincos2d", "fixed 2-D sin-cos positions: nothing to learn in a short run (see model.global_pool)"


def _patch_drop(f: Facts, v: Values) -> Choice:
    if f.source is not None and f.family == "vit":
        return 0.0, "fine-tune: every token, as the source was evaluated"
    if not f.scratch_vit or f.gpu:
        return None
    return 0.5, ("PatchDropout (Liu et al. 2023) drops half the patch tokens in training: ~1.9x the images/s on a CPU, "
                 "53.9% vs 45.4% at a fixed 5 minutes on CIFAR-10 (benchmarks guide)")


def _attention(f: Facts, v: Values) -> Choice:
    if not f.plans_architecture or f.gpu:  # measured on the compact ViT's ~65 tokens only
        return None
    return "math", ("CPU: vitflow's explicit attention (the logits in one GEMM, a hand-written backward) trains the "
                    "compact ViT's ~65 tokens faster than SDPA: 541 vs 350 img/s in 15-minute CIFAR-10 runs in bf16, "
                    "the same otherwise (benchmarks guide); in fp32 they tie")


def _at_model_size(f: Facts, size: int | None) -> bool:
    """Whether every sampled training image already has the model's input size ``size``."""
    return f.uniform and size is not None and f.short_side == size


def _crop_pct(f: Facts, v: Values) -> Choice:
    size, crop = input_size(f, v), v["data.crop_pct"]
    if f.source is not None or not _at_model_size(f, size):
        return None
    return 1.0, (f"every image is {size} px, the model's input size: evaluated whole, as training sees it (a {crop:g} "
                 f"center crop would zoom the evaluated images {photo_cache_size(size, crop) / size:.2f}x)")


def _batch(f: Facts, v: Values) -> Choice:
    top = 32 if f.source is not None else 128
    batch = min(top, _pow2_at_most(f.images / 4))
    why = ("fine-tune: the finetune recipe's batch 32" if f.source is not None else
           "batch 128 beat 64 at a fixed time (53.9% vs 47.0%, 5-minute CIFAR-10 runs)")
    return batch, f"{why}; at least 4 batches per epoch of {f.images} images"


def _lr(f: Facts, v: Values) -> Choice:
    batch = v["train.batch_size"]
    if f.source is not None:
        lr = float(f"{2e-4 * math.sqrt(batch / 32):.2g}")
        return lr, "fine-tune: 2e-4 at batch 32 (the finetune recipe), scaled with the square root of the batch"
    lr = float(f"{7e-4 * math.sqrt(batch / 128):.2g}")
    return lr, ("7e-4 at batch 128, the best of 3e-3 / 2e-3 / 1.2e-3 / 7e-4 in 5-minute CIFAR-10 runs (40.6 / 48.6 / "
                "51.5 / 53.9%), scaled with the square root of the batch (AdamW)")


def _layer_decay(f: Facts, v: Values) -> Choice:
    if f.source is None:
        return None
    return 0.75, "fine-tune: layer-wise lr decay 0.75 (BEiT / MAE): the blocks nearest the input change least"


# --- phase 1: the length, and what depends on it ----------------------------------------------------------

def _threads(f: Facts, v: Values) -> Choice:
    c = f.clock
    if c is None or len(c.by_threads) < 2 or c.threads == max(c.by_threads):
        return None
    most = max(c.by_threads)
    return c.threads, (f"{c.threads} thread: {c.step_s:.3g} s a step vs {c.by_threads[most]:.3g} s with {most} (measured "
                       "now: when other processes keep the cores busy, threads waiting for each other lose more than "
                       "they gain)")


def _time_budget(f: Facts, v: Values) -> Choice:
    default = v["train.default_budget"]
    if f.gpu or "train.total_steps" in f.user or not default or f.clock is None:
        return None
    return default, (f"no train.time_budget given on a CPU: fitted to train.default_budget={default} (set "
                     "train.default_budget=none to train the planned epochs instead)")


def epochs_steps(f: Facts, batch: int) -> tuple[int, int]:
    """``(epochs, steps)`` of the epoch-based length: from scratch 100 epochs below 20,000 images,
    else 30 (300 to 20,000 steps); a fine-tune 30 epochs (100 to 5,000 steps)."""
    per_epoch = max(1, f.images // batch)
    if f.source is not None:
        return 30, int(min(5_000, max(100, 30 * per_epoch)))
    epochs = 100 if f.images < 20_000 else 30
    return epochs, int(min(20_000, max(300, epochs * per_epoch)))


def evaluation_s(f: Facts) -> float:
    """Seconds of one periodic evaluation and the checkpoint written after it (0 without a clock)."""
    return f.eval_images * f.clock.eval_image_s + f.clock.checkpoint_s if f.clock else 0.0


def _fit(f: Facts, v: Values, tier: str) -> int | None:
    budget = v["train.time_budget"]
    if not budget or f.clock is None:
        return None
    seconds = parse_duration(budget)
    return fit_steps(seconds, f.clock.step_cost(tier), evaluation_s(f), evaluations(seconds, v),
                     f.final_images * f.clock.eval_image_s + f.clock.checkpoint_s)


def budget_steps(f: Facts, v: Values) -> int | None:
    """The steps ``train.time_budget`` holds at the measured speed, each step with the augmentation
    the run will take (:func:`augment_tier`), each evaluation with its checkpoint (``None``
    without a budget or a clock)."""
    return _fit(f, v, augment_tier(f, v))


def augment_tier(f: Facts, v: Values) -> str:
    """The device augmentation the run takes: ``strong`` (TrivialAugment and random erasing) or
    ``light`` (crops and flips). The user's, where they set ``data.auto_augment`` or
    ``data.random_erasing``; a fine-tune's light; else strong when :data:`LONG_EPOCHS` epochs or
    more are expected at the strong tier's own step cost (so the tier follows the steps that will
    really run, not those of a cheaper step)."""
    if {"data.auto_augment", "data.random_erasing"} & f.user:
        return "strong" if v["data.auto_augment"] != "none" or v["data.random_erasing"] > 0 else "light"
    if f.source is not None:
        return "light"
    fitted = _fit(f, v, "strong")
    steps = min(v["train.total_steps"], fitted) if fitted else v["train.total_steps"]
    return "strong" if steps * v["train.batch_size"] / max(f.images, 1) >= LONG_EPOCHS else "light"


def evaluations(seconds: float, v: Values) -> int:
    """The periodic evaluations of a run of ``seconds`` under ``train.eval_interval`` (before the final one)."""
    interval = v.get("train.eval_interval")
    return max(0, math.ceil(seconds / parse_duration(interval)) - 1) if interval else 0


HEADROOM = 1.2  # the planned schedule's most steps over the fitted ones: the run refits to its own speed


def _total_steps(f: Facts, v: Values) -> Choice:
    epochs, steps = epochs_steps(f, v["train.batch_size"])
    fitted = budget_steps(f, v)
    if fitted is None:
        return steps, f"{epochs} epochs of {f.images} images"
    if finetune_fits(f, v):
        return steps, f"fine-tune: {epochs} epochs of {f.images} images (they fit train.time_budget)"
    top = max(fitted + 1, int(fitted * HEADROOM))
    return top, (f"the schedule's most steps: {HEADROOM:g} x the {fitted} that fit train.time_budget="
                 f"{v['train.time_budget']} at the measured {f.clock.step_cost(augment_tier(f, v)):.3g} s a step; the run refits its "
                 "schedule to its own speed as it goes")


def expected_steps(f: Facts, v: Values) -> int:
    """The steps the run is expected to take: the budget's fit when it holds fewer than
    ``train.total_steps``, else ``train.total_steps``."""
    fitted = budget_steps(f, v)
    return min(v["train.total_steps"], fitted) if fitted else v["train.total_steps"]


def planned_epochs(f: Facts, v: Values) -> float:
    """Epochs of the expected length (:func:`expected_steps`) at ``train.batch_size``."""
    return expected_steps(f, v) * v["train.batch_size"] / max(f.images, 1)


def _warmup(f: Facts, v: Values) -> Choice:
    steps = expected_steps(f, v)
    return max(1, round(steps / 20)), f"5% of the {steps} expected steps"


def finetune_fits(f: Facts, v: Values) -> bool:
    """Whether a fine-tune's planned epochs (:func:`epochs_steps`) fit ``train.time_budget`` at the
    measured speed: it then trains those epochs, however short, instead of filling the budget."""
    if f.source is None:
        return False
    fitted = budget_steps(f, {**v, "train.eval_interval": None})
    return fitted is not None and epochs_steps(f, v["train.batch_size"])[1] <= fitted


def _eval_interval(f: Facts, v: Values) -> Choice:
    budget = v["train.time_budget"]
    if not budget or "train.eval_every" in f.user:
        return None
    if finetune_fits(f, v):
        return None, (f"fine-tune: its {epochs_steps(f, v['train.batch_size'])[0]} epochs fit train.time_budget="
                      f"{budget}: evaluations spaced in steps over them (see train.eval_every)")
    seconds = parse_duration(budget)
    one = evaluation_s(f)
    n = evaluation_count(seconds, one)
    why = (f"{n} evaluations spread over train.time_budget={budget}: the first after ~{100 / n:.0f}% of the run"
           + (f" (each ~{one:.1f} s: {n * one / seconds:.0%} of the time)" if n < EVALUATIONS else ""))
    return f"{max(1, round(seconds / n))}s", why


def _eval_every(f: Facts, v: Values) -> Choice:
    if v.get("train.eval_interval"):
        return 0, f"evaluations every train.eval_interval={v['train.eval_interval']} of training time instead"
    steps = expected_steps(f, v)
    return max(1, steps // EVALUATIONS), (f"{EVALUATIONS} evaluations over the {steps} expected steps: the first after "
                                          f"~{100 / EVALUATIONS:.0f}% of the run")


def _checkpoint_every(f: Facts, v: Values) -> Choice:
    if v["train.eval_every"]:
        return v["train.eval_every"], "a checkpoint at each evaluation"
    return 0, "a checkpoint after each timed evaluation (train.eval_interval) and at the end"


SHORT_EPOCHS, LONG_EPOCHS, MIX_EPOCHS = 20, 80, 300


def _augment(f: Facts, v: Values) -> Choice:
    epochs, size = planned_epochs(f, v), input_size(f, v)
    if f.source is not None:
        return None  # the finetune recipe's modest crops
    if epochs < SHORT_EPOCHS and _at_model_size(f, size):
        return "none", (f"~{epochs:.0f} epochs underfit: flips only (no crops and no label smoothing gained 3.2 points "
                        "at ~6 epochs of CIFAR-10, 51.5 -> 54.7%)")
    if _at_model_size(f, size) and size <= 32:
        return "pad_crop", f"~{epochs:.0f} epochs: pad-and-crop, the small-image recipe (He et al. 2016)"
    return "random_resized_crop", f"~{epochs:.0f} epochs: random-resized crops on the device (Szegedy et al. 2015)"


def _scale(f: Facts, v: Values) -> Choice:
    if f.source is not None or v["data.train_augment"] != "random_resized_crop":
        return None
    epochs = planned_epochs(f, v)
    low = 0.5 if epochs < SHORT_EPOCHS else 0.25 if epochs < LONG_EPOCHS else 0.08
    return (low, 1.0), f"~{epochs:.0f} epochs: crops of at least {low:.0%} of the image (stronger for longer runs)"


def _label_smoothing(f: Facts, v: Values) -> Choice:
    epochs = planned_epochs(f, v)
    if f.source is None and epochs < SHORT_EPOCHS:
        return 0.0, f"~{epochs:.0f} epochs underfit: no label smoothing (see data.train_augment)"
    return 0.1, f"~{epochs:.0f} epochs: label smoothing 0.1 (Szegedy et al. 2016)"


def _policy(f: Facts, v: Values) -> Choice:
    epochs = planned_epochs(f, v)
    if augment_tier(f, v) == "strong":
        return "trivialaugment", (f"~{epochs:.0f} epochs: TrivialAugment (Muller & Hutter 2021), batched on the device, "
                                  "against overfitting a long run")
    return "none", f"~{epochs:.0f} epochs: no augmentation policy (it slows learning in short runs)"


def _erasing(f: Facts, v: Values) -> Choice:
    epochs = planned_epochs(f, v)
    if augment_tier(f, v) == "strong":
        return 0.25, f"~{epochs:.0f} epochs: random erasing p=0.25 (Zhong et al. 2020; DeiT's), batched on the device"
    return 0.0, f"~{epochs:.0f} epochs: no random erasing"


def _mix(f: Facts, v: Values, alpha: float, what: str) -> Choice:
    epochs = planned_epochs(f, v)
    if f.source is None and epochs >= MIX_EPOCHS:
        return alpha, f"~{epochs:.0f} epochs of {f.images} images: {what} (DeiT's 300-epoch recipe)"
    return 0.0, f"~{epochs:.0f} epochs: no {what.split(' ')[0]}"


RULES: tuple[Rule, ...] = (
    Rule("model.img_size", (), _img_size),
    Rule("model.patch_size", ("model.img_size",), _patch_size),
    Rule("model.name", ("model.img_size", "model.patch_size"), _model_name),
    Rule("model.global_pool", (), _global_pool),
    Rule("model.pos_embed", (), _pos_embed),
    Rule("model.patch_drop_rate", (), _patch_drop),
    Rule("model.attention", (), _attention),
    Rule("data.crop_pct", ("model.img_size",), _crop_pct),
    Rule("train.batch_size", (), _batch),
    Rule("optim.lr", ("train.batch_size",), _lr),
    Rule("optim.layer_decay", (), _layer_decay),
    Rule("train.threads", (), _threads, 1),
    Rule("train.time_budget", ("train.default_budget", "train.total_steps"), _time_budget, 1),
    Rule("train.eval_interval", ("train.time_budget", "train.eval_every"), _eval_interval, 1),
    Rule("train.total_steps", ("train.batch_size", "train.time_budget", "train.eval_interval"), _total_steps, 1),
    Rule("optim.warmup_steps", ("train.total_steps", "train.time_budget", "train.batch_size"), _warmup, 1),
    Rule("train.eval_every", ("train.eval_interval", "train.total_steps", "train.time_budget"), _eval_every, 1),
    Rule("train.checkpoint_every", ("train.eval_every",), _checkpoint_every, 1),
    Rule("data.train_augment", ("train.total_steps", "train.batch_size", "model.img_size"), _augment, 1),
    Rule("data.scale", ("data.train_augment", "train.total_steps", "train.batch_size"), _scale, 1),
    Rule("train.label_smoothing", ("train.total_steps", "train.batch_size"), _label_smoothing, 1),
    Rule("data.auto_augment", ("train.total_steps", "train.batch_size"), _policy, 1),
    Rule("data.random_erasing", ("train.total_steps", "train.batch_size"), _erasing, 1),
    Rule("data.mixup_alpha", ("train.total_steps", "train.batch_size"), lambda f, v: _mix(f, v, 0.8, "Mixup alpha 0.8"), 1),
    Rule("data.cutmix_alpha", ("train.total_steps", "train.batch_size"), lambda f, v: _mix(f, v, 1.0, "CutMix alpha 1.0"), 1),
    Rule("train.race", ("model.name", "train.time_budget"), race_choice, 1),
)


def run_rules(facts: Facts, values: Values, phase: int) -> list[tuple[str, Any, str]]:
    """Apply the rules of ``phase`` in order to ``values`` (updated in place) for every key the user
    did not set; returns the planned ``(key, value, why)``."""
    out = []
    for rule in RULES:
        if rule.phase != phase or rule.key in facts.user:
            continue
        choice = rule.choose(facts, values)
        if choice is not None:
            values[rule.key] = choice[0]
            out.append((rule.key, choice[0], choice[1]))
    return out
