"""The typed configuration tree: one dataclass per section, each with its own ``validate()``.

These checks need no other part of vitflow (ranges, combinations of values). Checks that need a
layer's knowledge (model variant names, split syntax, checkpointing specs, metric names) are that
layer's: :func:`vitflow.models.check_config`, :func:`vitflow.data.check_config` and
:func:`vitflow.training.track.selection.check_config`, which :func:`vitflow.config.build_config` runs when
given them (the CLI does; the trainer runs them too).

The ``model`` section is one class per kind of model (:mod:`.model_schema`): the keys every family
takes plus the family's own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from vitflow.config.checks import ConfigError
from vitflow.config.checks import check as _check
from vitflow.config.data_schema import DataConfig
from vitflow.config.model_schema import ModelConfig, ViTConfig

DEFAULT_PRESET = "digits-vit-tiny"


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule (per step; see :mod:`vitflow.training.optim.schedules`) and
    gradient clipping.

    LR scaling rule: each preset states its ``lr`` for its ``train.batch_size`` (the global batch,
    all ranks and micro-batches). For another batch size scale ``lr`` linearly with it (Goyal et
    al. 2017; DeiT uses ``5e-4 * batch / 512`` with AdamW) and keep the warmup in images, i.e.
    scale ``warmup_steps`` inversely.
    """

    name: Literal["adamw", "sgd"] = "adamw"  # AdamW, or SGD with Nesterov momentum
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.05  # not applied to norms, biases, pos_embed, cls_token
    betas: tuple[float, float] = (0.9, 0.999)  # adamw
    momentum: float = 0.9  # sgd (Nesterov)
    eps: float = 1e-8  # adamw denominator epsilon
    schedule: Literal["cosine", "linear", "step", "restarts", "constant"] = "cosine"  # after the warmup
    warmup_steps: int = 0  # linear warmup from 0 to lr
    min_lr: float = 0.0  # floor of cosine / linear / restarts
    milestones: tuple[float, ...] = (0.5, 0.75)  # step: steps (>= 1) or fractions of total_steps (< 1)
    gamma: float = 0.1  # step: factor at each milestone
    cycles: int = 1  # restarts: cosine cycles filling the schedule (SGDR)
    cycle_mult: float = 1.0  # restarts: each cycle this many times longer than the previous
    cycle_decay: float = 1.0  # restarts: peak of cycle i is lr * cycle_decay ** i
    layer_decay: float | None = None  # layer-wise lr decay (BEiT), e.g. 0.65 for fine-tuning
    clip_grad_norm: float | None = 1.0  # global L2 norm; None disables

    def validate(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        _check(all(0 <= b < 1 for b in self.betas), "optim.betas", self.betas, "each in [0, 1)")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _check(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr, "in [0, optim.lr]")
        _check(self.clip_grad_norm is None or self.clip_grad_norm > 0, "optim.clip_grad_norm",
               self.clip_grad_norm, "> 0 or null")
        _check(all(m > 0 for m in self.milestones) and list(self.milestones) == sorted(self.milestones),
               "optim.milestones", self.milestones, "positive and ascending")
        _check(0 < self.gamma <= 1, "optim.gamma", self.gamma, "in (0, 1]")
        _check(self.cycles >= 1, "optim.cycles", self.cycles, ">= 1")
        _check(self.cycle_mult >= 1, "optim.cycle_mult", self.cycle_mult, ">= 1")
        _check(0 < self.cycle_decay <= 1, "optim.cycle_decay", self.cycle_decay, "in (0, 1]")
        _check(self.layer_decay is None or 0 < self.layer_decay <= 1, "optim.layer_decay", self.layer_decay,
               "in (0, 1] or null")


@dataclass
class TrainConfig:
    """The training loop: steps, batches, precision, evaluation, checkpoints, run directory,
    EMA, compilation, the non-finite guard and data-parallel training."""

    batch_size: int = 128  # images per optimizer step (all micro-batches of all ranks together)
    accum_steps: int = 1  # micro-batches per step; each holds batch_size / accum_steps images
    total_steps: int = 1000  # optimizer steps of the run (the schedule's length)
    time_budget: str | None = None  # e.g. "15m": end cleanly (evaluate, checkpoint) by then
    # a planned run (vitflow train data.path=PHOTOS) on a CPU given neither train.time_budget nor train.total_steps
    # is fitted to this budget; none = train the planned epochs however long they take
    default_budget: str | None = "15m"
    # a planned run's race: model names (comma-separated) each planned and trained on this data, halved by their
    # validation top-1 (successive halving) inside train.time_budget, the winner continued; none = no race
    race: str = "none"
    label_smoothing: float = 0.1  # Szegedy et al. 2016; applied once, also to Mixup/CutMix targets (multiclass)
    # auto: cross_entropy (multiclass) or bce (multilabel); asl: asymmetric loss (Ridnik et al. 2021, multilabel)
    loss: Literal["auto", "cross_entropy", "bce", "asl"] = "auto"
    # weighted loss for imbalanced classes: none; balanced = n / (classes * count_c) (scikit-learn's
    # compute_class_weight; multilabel: BCE pos_weight = negatives / positives per class); or a .json / .txt
    # file of one weight per class (a JSON list or {class: weight}; text: one number per line)
    class_weights: str = "none"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 where supported and faster
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # torch intra-op threads; None = torch's default
    eval_every: int = 0  # steps between evaluations; 0 = only at the end
    # e.g. "90s": also evaluate (then checkpoint) each time this much time has passed since the last evaluation or
    # the start; evaluations spaced in time, whatever the speed (a planned run with a time budget uses it)
    eval_interval: str | None = None
    log_every: int = 20  # steps between metric records
    checkpoint_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest N kept in run_dir/checkpoints
    seed: int = 0  # model initialisation, batch order and augmentation
    run_dir: str | None = None  # None = runs/<preset>-<timestamp>
    resume: str = "none"  # none | auto | path to a checkpoint
    # choose by timing again (fp32 GEMM, attention / bf16 GEMM per shape, precision=auto) instead of taking a resumed
    # checkpoint's or the machine's cached choices; a resume is then not promised to be bit-identical
    retime: bool = False
    ema_decay: float = 0.0  # EMA of the weights, e.g. 0.999; 0 = off
    ema_warmup: bool = True  # effective decay min(ema_decay, (1 + n) / (10 + n)) after n updates
    compile: bool = False  # torch.compile the training forward/backward
    max_nonfinite_steps: int = 10  # this many non-finite steps in a row stop the run
    distributed: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: DDP, or FSDP2 (fully_shard)
    tensorboard: bool = True  # also write TensorBoard events when tensorboard is installed
    # MLflow tracking (pip install 'vitflow[mlflow]'): true (= ./mlruns), a folder or file: URI (file store), or a
    # tracking URI (http(s)://HOST:PORT, sqlite:///mlflow.db); None = off
    mlflow: str | None = None
    mlflow_experiment: str | None = None  # MLflow experiment name; None = the preset's name
    # Weights & Biases (pip install 'vitflow[wandb]'): online | offline (a local run folder for `wandb sync`) |
    # auto (WANDB_MODE, else online) | none (off)
    wandb: Literal["none", "auto", "online", "offline"] = "none"
    wandb_project: str | None = None  # W&B project; None = WANDB_PROJECT, else the preset's name
    # keep the best checkpoint (checkpoints/best.pt) by this evaluated figure: val_top1, val_loss, val_f1 ... or NAME_*
    keep_best: str | None = None
    early_stopping_patience: int = 0  # evaluations without improvement that end the run; 0 = off
    early_stopping_min_delta: float = 0.0  # the least change that counts as an improvement (metric units)
    early_stopping_metric: str | None = None  # the figure early stopping watches; None = train.keep_best's
    live_report: bool = True  # vitflow train: rewrite RUN_DIR/report.html after every evaluation

    def validate(self) -> None:
        for key in ("batch_size", "accum_steps", "total_steps", "log_every", "keep_checkpoints"):
            _check(getattr(self, key) > 0, f"train.{key}", getattr(self, key), "> 0")
        _check(self.batch_size % self.accum_steps == 0, "train.batch_size", self.batch_size,
               f"a multiple of train.accum_steps={self.accum_steps}")
        _check(0 <= self.label_smoothing < 1, "train.label_smoothing", self.label_smoothing, "in [0, 1)")
        _check(self.class_weights in ("none", "balanced") or os.path.isfile(self.class_weights), "train.class_weights",
               self.class_weights, "none, balanced or an existing .json / .txt file of per-class weights")
        _check(self.eval_every >= 0, "train.eval_every", self.eval_every, ">= 0")
        _check(self.checkpoint_every >= 0, "train.checkpoint_every", self.checkpoint_every, ">= 0")
        _check(self.threads is None or self.threads > 0, "train.threads", self.threads, "> 0")
        _check(0 <= self.ema_decay < 1, "train.ema_decay", self.ema_decay, "in [0, 1)")
        _check(self.max_nonfinite_steps > 0, "train.max_nonfinite_steps", self.max_nonfinite_steps, "> 0")
        _check_selection(self)
        _check(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device) is not None, "train.device",
               self.device, "auto, cpu, cuda, cuda:N or mps")
        _check(self.mlflow is None or self.mlflow.strip() != "", "train.mlflow", self.mlflow,
               "true, a folder or a tracking URI (or null: off)")
        for key in ("time_budget", "default_budget", "eval_interval"):
            if getattr(self, key) is not None:
                try:
                    parse_duration(getattr(self, key))
                except ValueError as e:
                    raise ConfigError(f"train.{key}: {e}", f"train.{key}") from None


def _check_selection(t: "TrainConfig") -> None:
    """Early stopping's numbers. Whether train.keep_best / train.early_stopping_metric name a known
    metric is checked by the train layer (vitflow.training.track.selection.check_config), which reads the
    metric table."""
    _check(t.early_stopping_patience >= 0, "train.early_stopping_patience", t.early_stopping_patience, ">= 0")
    _check(t.early_stopping_min_delta >= 0, "train.early_stopping_min_delta", t.early_stopping_min_delta, ">= 0")
    _check(not t.early_stopping_patience or t.keep_best or t.early_stopping_metric, "train.early_stopping_patience",
           t.early_stopping_patience, "0 unless train.keep_best or train.early_stopping_metric names a metric")
    _check(not t.early_stopping_patience or t.eval_every > 0, "train.early_stopping_patience",
           t.early_stopping_patience, "0 unless train.eval_every > 0 (it counts evaluations)")


@dataclass
class DistillConfig:
    """Knowledge distillation from a teacher checkpoint (Hinton et al. 2015; DeiT, Touvron et al.
    2021). Off while ``teacher`` is unset."""

    teacher: str | None = None  # a vitflow checkpoint (file or run directory) trained on the same classes
    kind: Literal["soft", "hard"] = "hard"  # soft: KL at temperature tau; hard: CE on the teacher's argmax
    alpha: float = 0.5  # weight of the distillation term; 1 - alpha on the label loss
    tau: float = 1.0  # soft-distillation temperature

    def validate(self) -> None:
        _check(0 <= self.alpha <= 1, "distill.alpha", self.alpha, "in [0, 1]")
        _check(self.tau > 0, "distill.tau", self.tau, "> 0")


@dataclass
class FinetuneConfig:
    """What trains when fine-tuning a pretrained backbone (``model.pretrained``): every weight
    (``full``, the default, optionally with the patch embedding and the first blocks frozen and
    ``optim.layer_decay``), the head alone (``linear_probe``), the head then everything (``lp_ft``,
    Kumar et al. 2022), or low-rank adapters plus the head (``lora``, Hu et al. 2021). Frozen
    weights get no gradient and no optimizer state. See :mod:`vitflow.training.optim.finetune`."""

    # full | linear_probe (frozen backbone, the head trains) | lp_ft (head first, then all) | lora (adapters + head)
    mode: Literal["full", "linear_probe", "lp_ft", "lora"] = "full"
    freeze_patch_embed: bool = False  # full / lp_ft: freeze the patch embedding, position embedding and tokens
    freeze_blocks: int = 0  # full / lp_ft: freeze the first K transformer blocks
    probe_steps: float = 0.25  # lp_ft: head-only steps (>= 1), or a fraction of train.total_steps (< 1)
    lora_rank: int = 8  # lora: rank r of the adapters B (out x r) A (r x in)
    lora_alpha: float = 16.0  # lora: the update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # lora: dropout on the adapters' input
    # lora: linear layers adapted, by module name or suffix (add mlp.fc1, mlp.fc2 for the MLP projections);
    # the q_proj / k_proj / v_proj names are EVA-02's separate projections (names a model lacks are skipped)
    lora_targets: tuple[str, ...] = ("attn.qkv", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.proj")

    def validate(self) -> None:
        _check(self.freeze_blocks >= 0, "finetune.freeze_blocks", self.freeze_blocks, ">= 0")
        partial = self.freeze_patch_embed or self.freeze_blocks > 0
        _check(not partial or self.mode in ("full", "lp_ft"), "finetune.mode", self.mode,
               "full or lp_ft with finetune.freeze_patch_embed / finetune.freeze_blocks")
        _check(self.probe_steps > 0 and (self.probe_steps < 1 or float(self.probe_steps).is_integer()),
               "finetune.probe_steps", self.probe_steps, "a whole number of steps >= 1 or a fraction in (0, 1)")
        _check(self.lora_rank >= 1, "finetune.lora_rank", self.lora_rank, ">= 1")
        _check(self.lora_alpha > 0, "finetune.lora_alpha", self.lora_alpha, "> 0")
        _check(0 <= self.lora_dropout < 1, "finetune.lora_dropout", self.lora_dropout, "in [0, 1)")
        _check(len(self.lora_targets) > 0, "finetune.lora_targets", self.lora_targets, "at least one module name")

    def probe_end(self, total_steps: int) -> int:
        """lp_ft: the step at which the backbone is unfrozen (``probe_steps`` resolved against
        ``total_steps``)."""
        return int(self.probe_steps) if self.probe_steps >= 1 else max(1, round(self.probe_steps * total_steps))


@dataclass
class Config:
    """The whole configuration of a run: the sections below (see the configuration reference for
    every key) plus the preset it was built from."""

    preset: str = DEFAULT_PRESET  # the preset the run was built from (names its run directory)
    description: str = ""  # one line about the recipe (presets carry one)
    model: ModelConfig = field(default_factory=ViTConfig)  # the model family's own section (model_schema.py)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def validate(self) -> "Config":
        for section in (self.model, self.data, self.optim, self.train, self.distill, self.finetune):
            section.validate()
        ft = self.finetune
        _check(ft.mode != "lp_ft" or ft.probe_end(self.train.total_steps) < self.train.total_steps,
               "finetune.probe_steps", ft.probe_steps, f"below train.total_steps={self.train.total_steps} with "
               "finetune.mode=lp_ft (the backbone must be unfrozen before the end)")
        multilabel = self.data.task == "multilabel"
        _check(self.train.loss in ("auto", "bce", "asl") if multilabel else self.train.loss in ("auto", "cross_entropy"),
               "train.loss", self.train.loss,
               "auto, bce or asl with data.task=multilabel" if multilabel else "auto or cross_entropy (bce and asl are "
               "for data.task=multilabel)")
        _check(not multilabel or self.distill.teacher is None, "distill.teacher", self.distill.teacher,
               "unset with data.task=multilabel (distillation is for single-label classifiers)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_duration(text: str | float | int) -> float:
    """Seconds from ``"90"``, ``"90s"``, ``"15m"``, ``"1.5h"``.

    Raises:
        ValueError: not a positive duration.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive duration like 900, 90s, 15m or 1.5h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
