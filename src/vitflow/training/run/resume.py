"""What a run continues from: the checkpoint ``train.resume`` points at (unreadable newest ones
skipped), the run's saved configuration, and restoring a checkpoint's model and training state.
A resume needs only the run: ``vitflow resume RUN`` (or ``train.resume=auto train.run_dir=RUN``)
restores its config, and overrides given with it are applied and listed."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import yaml

from vitflow import checkpoint as ckpt
from vitflow import timing
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
from vitflow.data.sources.splits import changed_selections
from vitflow.evaluation import scalar_metrics
from vitflow.models import config_class
from vitflow.models.kernels import onednn
from vitflow.rundir import BEST, CONFIG
from vitflow.runtime import mix_seed, rng_state, set_rng_state
from vitflow.training.optim.schedules import set_total_steps
from vitflow.training.run.folder import RunClaim, check_new_run, claim_run_dir, run_dir_for
from vitflow.training.scale.distributed import DistEnv

log = logging.getLogger(__name__)

_RUN_KEYS = ("train.resume", "train.run_dir", "train.time_budget", "train.retime")  # where/how long/this start only


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
        if not (ckpt.list_checkpoints(p) if p.is_dir() else p.is_file()):
            raise FileNotFoundError(f"train.resume={r}: no checkpoint there")
        state = ckpt.load_checkpoint(p)  # a run directory: its newest readable one
        return Path(state["path"]), state
    run = resumed_run_dir(t.resume, t.run_dir, preset)
    state = ckpt.newest_readable(run) if run else None
    if state is not None:
        return Path(state["path"]), state
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
    cfg = build_config(base=saved, overrides=["train.retime=false", *overrides, f"train.run_dir={run}"],
                       checks=checks, model_config=config_class)  # (--retime is for the start that asks)
    old, new = flatten(saved), flatten(yaml.safe_load(to_yaml(cfg)))  # both as YAML values (lists, not tuples)
    changed = [f"{k} {old.get(k)!r} -> {new[k]!r}" for k in sorted(new) if old.get(k) != new[k] and k != "train.retime"]
    log.info("resuming %s with its saved config%s", run, f"; changed: {'; '.join(changed)}" if changed else "")
    return cfg


def locate_run(t: TrainConfig, preset: str, config: dict[str, Any], dist: DistEnv
               ) -> tuple[dict[str, Any] | None, Path, bool, RunClaim]:
    """Where a run starts: ``(resumed checkpoint state or None, run directory, starts over, the
    claim on the run directory)``. Rank 0 claims the folder first (:func:`~vitflow.training.run.folder.
    claim_run_dir`: one writer per folder), then decides for every rank; the other ranks wait on
    its decision (and raise its error) and hold an empty claim. ``config``: the run's whole config
    as a mapping (compared with the checkpoint's). ``starts over``: a vitflow run directory without
    a readable checkpoint that ``train.resume=auto`` continues from step 0 (its records are emptied).

    Raises:
        FileNotFoundError / ValueError: see :func:`find_resume` and :func:`check_resume`;
        RunDirBusy: another process holds the folder; RunDirError: a ``train.run_dir`` that
        cannot take a run from step 0 (see :func:`~vitflow.training.run.folder.check_new_run`).
    """
    claim = found = payload = None
    if dist.is_main:
        try:
            claim, found, run_dir, over = _claim_and_find(t, preset, config)
            payload = (str(found[0]) if found else None, str(run_dir), over)
        except (ValueError, OSError) as e:  # every rank raises it (the others would wait forever)
            payload = e
    shared = dist.broadcast(payload)
    if isinstance(shared, BaseException):
        raise shared
    path, run_dir, over = shared
    state = found[1] if found else (ckpt.load_checkpoint(path) if path else None)
    if state is not None and not dist.is_main:
        check_resume(state, t, config, warn=False)
    reuse_choices(state, t.retime, dist.is_main)
    return state, Path(run_dir), over, claim or RunClaim(Path(run_dir))


def reuse_choices(state: dict[str, Any] | None, retime: bool, warn: bool = True) -> None:
    """A resumed run computes as its first steps did: the choices made by timing that its checkpoint
    recorded (:mod:`vitflow.timing`: the fp32 GEMM, ``precision=auto``, the attention backend and the
    bf16 GEMM per shape, Swin's window kernel) become this process's, and a line lists them. With
    ``retime`` (``train.retime``, ``--retime``) every choice is timed again, the machine's cache
    unread, and (resuming, ``warn``: rank 0) a warning says that the run is then not promised to
    round as an uninterrupted one."""
    timing.set_retime(retime)
    if state is None:
        return
    if retime:
        if warn:
            log.warning("--retime: the choices made by timing are made again, not taken from %s; the resumed run is "
                        "not promised to be bit-identical to an uninterrupted one", state["path"])
        return
    if state.get("fp32_gemm"):  # (also in checkpoints from before the record)
        onednn.set_fp32_gemm(state["fp32_gemm"])
    choices = state.get("choices") or {}
    timing.adopt(choices)
    shown = [f"fp32 GEMM {state['fp32_gemm']}"] if state.get("fp32_gemm") else []
    shown += [f"{kind} " + ", ".join(f"{v} x{n}" for v, n in sorted(Counter(table.values()).items()))
              for kind, table in sorted(choices.items()) if kind != onednn.KIND]
    if shown:
        log.info("resuming with the choices made by timing that %s recorded (%s); --retime makes them again",
                 state["path"], "; ".join(shown))


def _claim_and_find(t: TrainConfig, preset: str, config: dict[str, Any]
                    ) -> tuple[RunClaim, tuple[Path, dict[str, Any]] | None, Path, bool]:
    """Rank 0's part of :func:`locate_run`: claim the folder this start writes, before anything is
    read from it or checked; then the checkpoint it resumes and whether a new run may use the folder.
    Returns ``(claim, found, run directory, starts over)``; an error releases the claim."""
    planned = Path(t.run_dir) if t.run_dir else (resumed_run_dir(t.resume, None, preset) if t.resume != "none"
                                                 else None) or run_dir_for(t, preset, None)
    claim = claim_run_dir(planned)
    try:
        found = find_resume(t, preset)
        if found is not None:
            check_resume(found[1], t, config)
        run_dir = run_dir_for(t, preset, found[0] if found else None)
        if run_dir.resolve() != claim.path:  # train.resume=auto found nothing to continue: a new folder
            claim.release()
            claim = claim_run_dir(run_dir)
        over = False
        if found is None or run_dir.resolve() != found[0].parent.parent.resolve():
            over = check_new_run(run_dir, t.resume if found is None else "none")  # (a resume elsewhere: a fork)
        return claim, found, run_dir, over
    except BaseException:
        claim.release()
        raise


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
    they hold their defaults (:func:`vitflow.config.holds_old_default`), and so do the keys added since
    the checkpoint was written while they hold theirs (e.g. ``train.default_budget``)."""
    keys = config.get("model", {})
    old = {k: v for k, v in flatten(saved).items()
           if not (k.startswith("model.") and k[6:] not in keys and holds_old_default(k[6:], v))}
    new = flatten(config)
    defaults = flatten(Config().to_dict())
    old.update({k: v for k, v in new.items() if saved and k not in old and k in defaults and v == defaults[k]})
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
    """What a checkpoint of ``trainer`` (a :class:`~vitflow.training.loop.Trainer`) holds: weights,
    optimizer, schedule, loss scale, RNG states (every rank's), the loader position and skipped
    images, the records files' sizes a resume cuts them back to (``records``, default: now), the
    config, model arguments, classes, preprocessing, what each split selected
    (:func:`~vitflow.data.sources.splits.selection_record`), the last evaluation's figures, the multi-label
    threshold, the EMA, the guard, the callbacks' states, the fp32 GEMM the run chose and every choice
    made by timing (:func:`vitflow.timing.recorded`, all ranks'; :func:`reuse_choices`). Every
    rank must call it (FSDP state and the RNG states are gathered); ``None`` on ranks other than 0."""
    model_state = trainer.parallel.model_state(trainer.model)
    optimizer_state = trainer.parallel.optimizer_state(trainer.model, trainer.optimizer)
    rngs = trainer.dist.gather(rng_state())
    choices: dict[str, dict[str, str]] = {}  # every rank's (rank 0's where two differ: an evaluation's own)
    for ranks in reversed(trainer.dist.gather(timing.recorded())):
        for kind, table in ranks.items():
            choices.setdefault(kind, {}).update(table)
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
        "eval_due": trainer.eval_due, "fp32_gemm": onednn.decided(), "choices": choices,
        "splits": trainer.data.selection,
    }
    for key, value in trainer.callbacks.state_dict().items():  # (ProgressLog: "meter", Selection: "selection")
        if key in state:
            raise ValueError(f"a callback's state_key {key!r} is a key vitflow's checkpoints use: choose another")
        state[key] = value
    return state


def restore_training(state: dict, trainer) -> None:
    """Load a checkpoint's optimizer, schedule, loss scale, EMA, guard and callback states into a
    :class:`~vitflow.training.loop.Trainer` built for the resumed run (its choices made by timing were
    taken before, :func:`reuse_choices`). A changed ``train.total_steps`` stretches the restored
    schedule to it; a split that now selects other images than the run's is said in a warning
    (:func:`~vitflow.data.sources.splits.changed_selections`)."""
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
    log.info("resumed from %s at step %d", state["path"], trainer.step)
    for line in changed_selections(state.get("splits") or {}, trainer.data.selection, trainer.cfg.data.path):
        log.warning("the resumed run's %s", line)


def seed_ranks(state: dict | None, dist: DistEnv, seed: int, step: int) -> None:
    """The resumed run's RNG states (this rank's, when the rank count is the same), or, on several
    ranks, a different dropout stream each (from ``seed``, ``step`` and the rank)."""
    saved = (state or {}).get("rng_ranks") or []
    same_world = len(saved) == dist.world_size
    if state:
        set_rng_state(saved[dist.rank] if same_world else (saved or [state["rng"]])[0])
    if dist.enabled and not same_world:
        torch.manual_seed(mix_seed(seed, step, dist.rank))


def write_checkpoint(trainer, records: dict[str, int] | None = None, best: bool = False) -> Path | None:
    """Write a checkpoint of ``trainer``'s step (:func:`training_state`; ``records``: the records
    files' sizes a resume cuts back to) and keep the newest ``train.keep_checkpoints``; ``best``:
    ``best.pt``, never rotated. Every rank calls it; rank 0 writes and returns the path, others ``None``.

    Raises:
        vitflow.checkpoint.CheckpointWriteError: the write failed (the run's earlier checkpoints are
            intact; the message says how to continue).
    """
    state = training_state(trainer, records)
    if state is None:
        return None
    path = ckpt.checkpoint_path(trainer.run_dir, trainer.step)
    try:
        path = ckpt.save_checkpoint(state, path.with_name(BEST) if best else path)
    except ckpt.CheckpointWriteError as e:  # the run stops here; its previous checkpoints are intact
        raise ckpt.CheckpointWriteError(f"{e}; then continue with: vitflow resume {trainer.run_dir}") from None
    ckpt.prune_checkpoints(trainer.run_dir, trainer.cfg.train.keep_checkpoints)
    return path

