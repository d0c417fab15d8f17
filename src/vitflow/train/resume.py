"""What a run continues from: the checkpoint ``train.resume`` points at (unreadable newest ones
skipped), the run's saved configuration, and restoring a checkpoint's model and training state.
A resume needs only the run: ``vitflow resume RUN`` (or ``train.resume=auto train.run_dir=RUN``)
restores its config, and overrides given with it are applied and listed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import yaml

from vitflow import checkpoint as ckpt
from vitflow.config import (
    DEFAULT_PRESET,
    Config,
    TrainConfig,
    build_config,
    flatten,
    holds_old_default,
    parse_override,
    to_yaml,
)
from vitflow.evaluation import scalar_metrics
from vitflow.models import config_class
from vitflow.models.kernels import onednn
from vitflow.rundir import CONFIG
from vitflow.runtime import mix_seed, rng_state, set_rng_state
from vitflow.train.distributed import DistEnv
from vitflow.train.run_dir import check_new_run, run_dir_for
from vitflow.train.schedules import set_total_steps

log = logging.getLogger(__name__)

_RUN_KEYS = ("train.resume", "train.run_dir", "train.time_budget")  # where/how long, not what is trained


def find_resume(t: TrainConfig, preset: str) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint ``train.resume`` points at, loaded: ``(path, state)``, or ``None`` for a
    run from step 0.

    ``none``: no resume. A path: that checkpoint file, or the newest one of that run directory.
    ``auto``: the newest *readable* checkpoint in ``train.run_dir`` (or, when that is unset, in
    the most recently written ``runs/<preset>-*``): an unreadable newest one (a killed copy, a bad
    disk) is skipped with a warning naming it. ``None`` when there is none.

    Raises:
        FileNotFoundError: an explicit path without a checkpoint, or ``auto`` with a
            ``train.run_dir`` that does not exist (nothing to resume there: a typo?).
        ValueError: an explicit checkpoint that cannot be read.
    """
    r = t.resume
    if r == "none":
        return None
    if r != "auto":
        p = Path(r)
        found = ckpt.latest_checkpoint(p) if p.is_dir() else p
        if found is None or not found.is_file():
            raise FileNotFoundError(f"train.resume={r}: no checkpoint there")
        return found, ckpt.load_checkpoint(found)
    run = resumed_run_dir(t.resume, t.run_dir, preset)
    for path in reversed(ckpt.list_checkpoints(run) if run else []):
        try:
            return path, ckpt.load_checkpoint(path)
        except ValueError as e:
            log.warning("skipping unreadable checkpoint %s (%s); trying the one before it", path, e)
    log.info("train.resume=auto: no readable checkpoint in %s; the run starts from step 0",
             run or f"runs/{preset}-*")
    return None


def resumed_run_dir(resume: str, run_dir: str | None, preset: str) -> Path | None:
    """The run directory a resume continues: ``train.run_dir``; the folder of an explicit
    checkpoint; with ``auto`` and no run directory, the ``runs/<preset>-*`` with the newest
    checkpoint. ``None`` when there is none.

    Raises:
        FileNotFoundError: ``auto`` with a ``train.run_dir`` that does not exist.
    """
    if resume not in ("auto", "none") and not run_dir:
        p = Path(resume)
        return p if p.is_dir() else p.parent.parent
    if run_dir:
        if resume == "auto" and not Path(run_dir).exists():
            raise FileNotFoundError(f"train.run_dir={run_dir} does not exist: there is no run to resume there (a "
                                    "typo?); leave out train.resume=auto to start a new run in it")
        return Path(run_dir)
    runs = [(c.stat().st_mtime, d) for d in Path("runs").glob(f"{preset}-*") if (c := ckpt.latest_checkpoint(d))]
    return max(runs)[1] if runs else None


def resume_config(preset: str | None, overrides: Sequence[str], checks: Mapping[str, Any]) -> Config | None:
    """The config of a resumed run: its saved ``config.yaml`` with ``overrides`` applied (each
    changed key logged), when ``overrides`` ask for a resume (``train.resume``) of a run that has
    one; else ``None`` (build the config from the preset as usual).

    Raises:
        FileNotFoundError: see :func:`resumed_run_dir`; ConfigError: a bad override.
    """
    given = dict(parse_override(o) for o in overrides)
    resume = str(given.get("train.resume", "none"))
    if resume == "none":
        return None
    run = resumed_run_dir(resume, given.get("train.run_dir"), preset or DEFAULT_PRESET)
    if run is None or not (run / CONFIG).is_file():
        return None
    saved = yaml.safe_load((run / CONFIG).read_text())
    cfg = build_config(base=saved, overrides=[*overrides, f"train.run_dir={run}"], checks=checks,
                       model_config=config_class)
    old, new = flatten(saved), flatten(yaml.safe_load(to_yaml(cfg)))  # both as YAML values (lists, not tuples)
    changed = [f"{k} {old.get(k)!r} -> {new[k]!r}" for k in sorted(new) if old.get(k) != new[k]]
    log.info("resuming %s with its saved config%s", run, f"; changed: {'; '.join(changed)}" if changed else "")
    return cfg


def locate_run(t: TrainConfig, preset: str, config: dict[str, Any], dist: DistEnv
               ) -> tuple[dict[str, Any] | None, Path, bool]:
    """Where a run starts: ``(resumed checkpoint state or None, run directory, starts over)``;
    rank 0 decides for every rank. ``config``: the run's whole config as a mapping (compared with
    the checkpoint's). ``starts over``: a vitflow run directory without a readable
    checkpoint that ``train.resume=auto`` continues from step 0 (its records are emptied).

    Raises:
        FileNotFoundError / ValueError: see :func:`find_resume` and :func:`check_resume`;
        RunDirError: a ``train.run_dir`` that cannot take a run from step 0 (see
        :func:`~vitflow.train.run_dir.check_new_run`).
    """
    found = find_resume(t, preset) if dist.is_main else None
    path = dist.broadcast(str(found[0]) if found else None)
    state = found[1] if found else (ckpt.load_checkpoint(path) if path else None)
    if state is not None:
        check_resume(state, t, config, warn=dist.is_main)
    run_dir = Path(dist.broadcast(str(run_dir_for(t, preset, Path(path) if path else None)) if dist.is_main else None))
    over = False
    if dist.is_main and (state is None or run_dir.resolve() != Path(path).parent.parent.resolve()):
        over = check_new_run(run_dir, t.resume if state is None else "none")  # (a resume elsewhere: a fork)
    return state, run_dir, dist.broadcast(over)


def check_resume(state: dict[str, Any], t: TrainConfig, config: dict[str, Any], warn: bool = True
                 ) -> dict[str, Any]:
    """``state`` if the run may continue from it with the ``train`` section ``t``; with ``warn``,
    the keys of ``config`` (the whole config as a mapping) that changed since are logged.

    Raises:
        ValueError: the checkpoint is past ``train.total_steps`` (resuming would rewrite a longer
            run) without a time budget.
    """
    if int(state["step"]) > t.total_steps and not t.time_budget:
        raise ValueError(f"train.resume: {state['path']} is at step {state['step']}, past train.total_steps="
                         f"{t.total_steps}; raise train.total_steps to train on (vitflow eval evaluates it)")
    if warn:
        warn_config_changes(state.get("config") or {}, config, Path(state["path"]))
    return state


def warn_config_changes(saved: dict[str, Any], config: dict[str, Any], path: Path) -> None:
    """Log the keys of ``config`` (a config as a mapping) that differ from the checkpoint's: a resume
    with another batch size, lr, data or model does not reproduce the uninterrupted run (and may not
    load). The keys of an older flat ``model`` section that the family lacks count as unchanged while
    they hold their defaults (:func:`vitflow.config.holds_old_default`)."""
    keys = config.get("model", {})
    old = {k: v for k, v in flatten(saved).items()
           if not (k.startswith("model.") and k[6:] not in keys and holds_old_default(k[6:], v))}
    new = flatten(config)
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if k not in _RUN_KEYS and old.get(k) != new.get(k)]
    if changed:
        log.warning("resuming from %s with a changed config (%s); the run will not match an uninterrupted one",
                    path, "; ".join(changed))


def restore_model(model: torch.nn.Module, state: dict, classes: list[str], name: str) -> tuple[int, tuple[int, int]]:
    """Load a checkpoint's trained weights into ``model``; returns ``(step, loader position)``.

    Raises:
        ValueError: the checkpoint was trained on other classes, or its weights do not fit.
    """
    if state["classes"] != classes:
        raise ValueError(f"checkpoint {state['path']} was trained on classes {state['classes'][:5]}..., "
                         f"the data has {classes[:5]}...")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ValueError(f"checkpoint {state['path']} does not fit model {name}: {e}") from None
    return int(state["step"]), tuple(state["data"]["position"])


def training_state(trainer, records: dict[str, int] | None = None) -> dict[str, Any] | None:
    """What a checkpoint of ``trainer`` (a :class:`~vitflow.train.loop.Trainer`) holds: weights,
    optimizer, schedule, loss scale, RNG states (every rank's), the loader position and skipped
    images, the records files' sizes a resume cuts them back to (``records``, default: now), the
    config, model arguments, classes, preprocessing, the last evaluation's figures, the multi-label
    threshold, the EMA, the guard, the callbacks' states, and the fp32 GEMM the run chose. Every
    rank must call it (FSDP state and the RNG states are gathered); ``None`` on ranks other than 0."""
    model_state = trainer.parallel.model_state(trainer.model)
    optimizer_state = trainer.parallel.optimizer_state(trainer.model, trainer.optimizer)
    rngs = trainer.dist.gather(rng_state())
    if not trainer.dist.is_main:
        return None
    state = {
        "step": trainer.step, "model": model_state, "optimizer": optimizer_state,
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.precision.scaler.state_dict() if trainer.precision.scaler else None,
        "rng": rngs[0], "rng_ranks": rngs if trainer.dist.enabled else None,
        "data": {"position": list(trainer.epochs.position), "skipped": dict(trainer.epochs.skips.per_epoch)},
        "records": records or trainer.metrics.offsets(),
        "config": trainer.cfg.to_dict(), "model_args": trainer.model_args, "classes": trainer.data.classes,
        "preprocess": trainer.data.preprocess.to_dict(), "metrics": scalar_metrics(trainer.last_eval or {}),
        "task": trainer.data.task, "threshold": trainer.evaluator.threshold,
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None, "guard": trainer.guard.state_dict(),
        "eval_due": trainer.eval_due, "fp32_gemm": onednn.decided(),
    }
    for key, value in trainer.callbacks.state_dict().items():  # (ProgressLog: "meter", Selection: "selection")
        if key in state:
            raise ValueError(f"a callback's state_key {key!r} is a key vitflow's checkpoints use: choose another")
        state[key] = value
    return state


def restore_training(state: dict, trainer) -> None:
    """Load a checkpoint's optimizer, schedule, loss scale, EMA, guard and callback states (and the
    fp32 GEMM its run chose, :mod:`vitflow.models.kernels.onednn`) into a
    :class:`~vitflow.train.loop.Trainer` built for the resumed run. A changed
    ``train.total_steps`` stretches the restored schedule to it."""
    t = trainer.cfg.train
    trainer.parallel.load_optimizer_state(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if state["config"]["train"]["total_steps"] != t.total_steps:  # the user changed the length
        set_total_steps(trainer.scheduler, t.total_steps)
    if trainer.precision.scaler is not None and state.get("scaler"):
        trainer.precision.scaler.load_state_dict(state["scaler"])
    if trainer.ema is not None and state.get("ema"):
        trainer.ema.load_state_dict(state["ema"])
    if state.get("guard"):
        trainer.guard.load_state_dict(state["guard"])
    trainer.callbacks.load_state_dict(state)
    if state.get("fp32_gemm"):  # the run's fp32 GEMM, so that the resumed steps round as the first ones did
        onednn.set_fp32_gemm(state["fp32_gemm"])
    log.info("resumed from %s at step %d", state["path"], trainer.step)


def seed_ranks(state: dict | None, dist: DistEnv, seed: int, step: int) -> None:
    """The resumed run's RNG states (this rank's, when the rank count is the same), or, on several
    ranks, a different dropout stream each (from ``seed``, ``step`` and the rank)."""
    saved = (state or {}).get("rng_ranks") or []
    same_world = len(saved) == dist.world_size
    if state:
        set_rng_state(saved[dist.rank] if same_world else (saved or [state["rng"]])[0])
    if dist.enabled and not same_world:
        torch.manual_seed(mix_seed(seed, step, dist.rank))
