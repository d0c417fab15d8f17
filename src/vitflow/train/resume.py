"""Where a run lives and what it continues from: the run directory, the checkpoint
``train.resume`` points at, and restoring a checkpoint's model and training state."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

import torch

from vitflow import checkpoint as ckpt
from vitflow.config import Config, flatten, to_yaml
from vitflow.rundir import CONFIG
from vitflow.train.schedules import set_total_steps

log = logging.getLogger(__name__)

_RUN_KEYS = ("train.resume", "train.run_dir", "train.time_budget")  # where/how long, not what is trained


def find_resume(cfg: Config) -> Path | None:
    """The checkpoint ``train.resume`` points at.

    ``none``: no resume. ``auto``: the newest complete checkpoint in ``train.run_dir``, or, when
    that is unset, in the most recently written ``runs/<preset>-*`` directory; ``None`` when there
    is none (a fresh run). A path: that checkpoint file or run directory.

    Raises:
        FileNotFoundError: an explicit path that holds no checkpoint.
    """
    r = cfg.train.resume
    if r == "none":
        return None
    if r != "auto":
        p = Path(r)
        found = ckpt.latest_checkpoint(p) if p.is_dir() else p
        if found is None or not found.is_file():
            raise FileNotFoundError(f"train.resume={r}: no checkpoint there")
        return found
    if cfg.train.run_dir:
        found = ckpt.latest_checkpoint(cfg.train.run_dir)
    else:
        runs = [c for d in Path("runs").glob(f"{cfg.preset}-*") if (c := ckpt.latest_checkpoint(d))]
        found = max(runs, key=lambda c: c.stat().st_mtime) if runs else None
    if found is None:
        log.info("train.resume=auto: no checkpoint in %s; starting a new run",
                 cfg.train.run_dir or f"runs/{cfg.preset}-*")
    return found


def load_resume_state(path: Path | None, cfg: Config, warn: bool = True) -> dict[str, Any] | None:
    """The checkpoint to resume from (``None`` for a fresh run), after checking it may continue
    under ``cfg``; with ``warn``, the config keys that changed since are logged.

    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint; ValueError: it is past
        ``train.total_steps`` (resuming would rewrite a longer run) without a time budget.
    """
    if path is None:
        return None
    state = ckpt.load_checkpoint(path)
    t = cfg.train
    if int(state["step"]) > t.total_steps and not t.time_budget:
        raise ValueError(f"train.resume: {path} is at step {state['step']}, past train.total_steps="
                         f"{t.total_steps}; raise train.total_steps to train on (vitflow eval evaluates it)")
    if warn:
        warn_config_changes(state.get("config") or {}, cfg, path)
    return state


def warn_config_changes(saved: dict[str, Any], cfg: Config, path: Path) -> None:
    """Log the config keys that differ from the checkpoint's: a resume with another batch size,
    lr, data or model does not reproduce the uninterrupted run (and may not load)."""
    old, new = flatten(saved), flatten(cfg.to_dict())
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if k not in _RUN_KEYS and old.get(k) != new.get(k)]
    if changed:
        log.warning("resuming from %s with a changed config (%s); the run will not match an uninterrupted one",
                    path, "; ".join(changed))


def make_run_dir(cfg: Config, resume: Path | None) -> Path:
    """The run directory (``train.run_dir``; the resumed checkpoint's run; else
    ``runs/<preset>-<timestamp>``), created, with the resolved config written to it."""
    if cfg.train.run_dir:
        d = Path(cfg.train.run_dir)
    elif resume is not None:
        d = resume.parent.parent
    else:
        d = Path("runs") / f"{cfg.preset}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG).write_text(to_yaml(cfg))
    return d


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


def restore_training(state: dict, trainer) -> None:
    """Load a checkpoint's optimizer, schedule, loss scale, EMA and guard state into a
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
    log.info("resumed from %s at step %d", state["path"], trainer.step)
