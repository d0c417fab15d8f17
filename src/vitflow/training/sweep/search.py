"""A sweep's workers: the folder and storage opened once, then each worker asks the storage for
the next trial until ``--trials`` trials of all workers have finished.

No worker marks another's trial: a trial is only failed by its own worker, or by any worker once
its heartbeat has stopped (:mod:`.storage`). A worker whose trial would be past ``--trials``
(another asked at the same moment) drops it unrun, and a worker with nothing left to ask waits
for the last trials of the others, so that it can take one up if their worker dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from vitflow.config import DEFAULT_PRESET
from vitflow.training.sweep.records import summary
from vitflow.training.sweep.space import SweepError, default_direction, read_space
from vitflow.training.sweep.storage import HEARTBEAT_S, draws_before, open_storage, open_study, shown, surplus, tally
from vitflow.training.sweep.trial import run_trial

log = logging.getLogger(__name__)

SETTINGS, STORAGE, LOCK = "sweep.json", "sweep.db", ".sweep.lock"
EARLIER = {"storage": None, "study": "sweep"}  # what a sweep.json of an earlier vitflow meant by a key it lacks


@contextlib.contextmanager
def _folder(sweep_dir: Path, settings: dict[str, Any]) -> Iterator[None]:
    """The sweep folder, created or checked against ``settings``, locked (``flock``) while the
    block opens the storage: commands started together on one folder open it one after another.
    A folder this call created is removed again when the block raises.

    Raises:
        SweepError: the folder holds another sweep, or files that are not a sweep's.
    """
    def refuse_foreign() -> None:  # files, and no sweep's definition
        if not (sweep_dir / SETTINGS).is_file() and any(p.name != LOCK for p in sweep_dir.iterdir()):
            raise SweepError(f"--dir {sweep_dir} is not empty and holds no sweep ({SETTINGS}): choose another --dir")

    if sweep_dir.is_dir():
        refuse_foreign()  # before the lock file: a user's folder is left as it was
    created = not sweep_dir.exists()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sweep_dir / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        saved = sweep_dir / SETTINGS
        if saved.is_file():
            old = json.loads(saved.read_text())
            changed = [k for k in settings if old.get(k, EARLIER.get(k)) != settings[k]]
            if changed:
                raise SweepError(f"--dir {sweep_dir} holds another sweep (different {', '.join(changed)}): re-run it "
                                 "with the same options to continue it, or choose another --dir")
        else:
            refuse_foreign()  # (files that came meanwhile)
            tmp = saved.with_name(f".{SETTINGS}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(settings, indent=1))
            tmp.replace(saved)
        yield
    except BaseException:
        if created:
            shutil.rmtree(sweep_dir, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def run_sweep(space_file: str | Path, trials: int, sweep_dir: str | Path | None = None, preset: str | None = None,
              config_file: str | None = None, overrides: Sequence[str] = (), metric: str = "val_top1",
              direction: str | None = None, seed: int = 0, prune_after: int = 3,
              checks: Mapping[str, Callable] | None = None, echo: Callable[[str], None] = print, *,
              storage: str | None = None, study: str = "sweep", workers: int = 1, threads: int | None = None,
              heartbeat: int = HEARTBEAT_S, retry_failed: int = 1) -> dict[str, Any]:
    """Run (or join, or continue) a sweep to ``trials`` finished trials; see the package docstring.

    Args:
        space_file: the search space (:func:`~vitflow.training.sweep.space.read_space`).
        sweep_dir: the sweep folder (default ``sweeps/<preset>-<space file name>``).
        metric: the objective, a figure of the run summary (``val_top1``, ``val_loss``, ``test_top1``...).
        direction: ``maximize`` / ``minimize`` (default: :func:`default_direction`).
        prune_after: trials that run to the end before the median rule prunes any.
        checks: the layers' config checks (as :func:`vitflow.config.build_config` takes them).
        storage: an SQLAlchemy URL (``postgresql://...``, ``mysql+pymysql://...``) shared by every worker;
            default ``sqlite:///SWEEP_DIR/sweep.db``. study: the search's name in the storage.
        workers: trials at a time on this machine (that many processes, the cores split between them).
        threads: each trial's ``train.threads`` (unless the overrides set it).
        heartbeat: seconds between a running trial's heartbeats; a trial silent for 3 of them is
            its worker's death. retry_failed: times such a trial runs again, from its checkpoint.
    Returns:
        ``sweep_dir``, ``trials`` (finished, all workers), ``complete``, ``pruned``, ``failed``,
        ``best`` (trial, value, params, run_dir; ``None`` before a trial completes), ``table``,
        ``best_config``, ``workers``.
    Raises:
        SweepError: a bad space file, metric, folder or storage (one line, nothing changed);
        SweepInterrupted: a signal stopped a trial.
    """
    try:
        import optuna
    except ImportError:
        raise SweepError("vitflow sweep needs the optuna package: pip install 'vitflow[sweep]'") from None
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # each trial's worker records its heartbeats itself (storage.Heartbeat), around ask and tell
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    space = read_space(space_file)
    direction = direction or default_direction(metric)
    preset = preset or DEFAULT_PRESET
    sweep_dir = Path(sweep_dir or Path("sweeps") / f"{preset}-{Path(space_file).stem}")
    settings = {"preset": preset, "config": config_file, "space": space, "overrides": list(overrides),
                "metric": metric, "direction": direction, "seed": seed}
    if storage is not None and not storage.strip():
        raise SweepError(f"--storage {storage!r}: an empty URL (leave --storage out for the folder's own {STORAGE})")
    shared = open_storage(storage, heartbeat, retry_failed) if storage else None  # first: a bad URL changes nothing
    with _folder(sweep_dir, {**settings, "storage": storage and shown(storage), "study": study}):
        store = shared or open_storage(f"sqlite:///{(sweep_dir / STORAGE).resolve()}", heartbeat, retry_failed)
        found = open_study(store, study, settings, direction, prune_after)
    if workers > 1:
        from vitflow.training.sweep.workers import run_workers

        run_workers(workers, run_sweep, dict(space_file=space_file, trials=trials, sweep_dir=sweep_dir, preset=preset,
                                  config_file=config_file, overrides=list(overrides), metric=metric,
                                  direction=direction, seed=seed, prune_after=prune_after, checks=checks,
                                  storage=storage, study=study, heartbeat=heartbeat, retry_failed=retry_failed))
    else:
        base = dict(preset=preset, config_file=config_file, overrides=list(overrides), checks=checks, threads=threads)
        work(found, trials, seed, lambda t: run_trial(found, t, space, base, sweep_dir, metric, echo), echo, heartbeat)
    return {**summary(found, sweep_dir, metric, direction), "workers": workers}


def work(study, trials: int, seed: int, run: Callable[[Any], None], echo: Callable[[str], None],
         poll: float) -> None:
    """One worker's loop: ask for a trial and ``run`` it while fewer than ``trials`` trials of all
    workers have finished and are running; wait (every ``poll`` s) while the last ones run elsewhere."""
    import optuna

    now = tally(study)
    if now.finished >= trials:
        echo(f"the sweep has {now.finished} finished trials (--trials {trials}): nothing to run (a larger --trials "
             "runs more)")
        return
    said = False
    while now.finished < trials:
        if now.finished + now.running >= trials:
            if not said:
                echo(f"{now.finished} of {trials} trials finished, the last {now.running} running in other workers: "
                     "waiting for them (a trial whose worker dies runs again here)")
                said = True
            time.sleep(poll)
        else:
            trial = study.ask()
            if surplus(study, trial.number, trials):  # another worker asked at the same moment, for the last one
                trial.set_user_attr("surplus", True)
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                # seeded by the draws before it: a lone worker proposes what it always would, a stop and a
                # continuation included; workers asking at once see each other's trial and differ
                study.sampler = optuna.samplers.TPESampler(seed=seed + draws_before(study, trial.number),
                                                           constant_liar=True)
                run(trial)
        now = tally(study)
