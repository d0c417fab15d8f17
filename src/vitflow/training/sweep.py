"""``vitflow sweep``: a hyperparameter search with Optuna over any config keys.

Each trial is a normal vitflow run directory ``SWEEP_DIR/trial-NNNN`` (train it, resume it, report
it, evaluate it as any run), trained in this process with the preset, config file and overrides of
the command plus the trial's sampled values; its budget is the run's own (``train.total_steps``
or ``train.time_budget`` among the overrides). The sampler is TPE (Bergstra et al. 2011), seeded;
the pruner is Optuna's median rule: at each evaluation during training (``train.eval_every``) a
trial whose metric is worse than the median of the earlier trials at the same step stops there.

The sweep folder holds::

    SWEEP_DIR/sweep.json        the sweep's definition (preset, space, overrides, metric, direction, seed)
    SWEEP_DIR/sweep.db          Optuna's storage (SQLite): every trial, its intermediate values, its state
    SWEEP_DIR/sweep.csv         trial, state, value, the sampled keys, run_dir, seconds, note; after each trial
    SWEEP_DIR/best.yaml         the best trial's full config, for `vitflow train --config best.yaml`
    SWEEP_DIR/trial-NNNN/       the trials' run directories

Running the same command again continues the sweep to ``--trials`` finished trials (complete,
pruned, or failed on an error); a trial stopped by SIGINT/SIGTERM, or left running by a killed
process, is marked failed and its values run again first (in a new run directory). The search
space file maps config keys to distributions::

    optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
    optim.warmup_steps: {type: int, low: 0, high: 50, step: 10}
    model.drop_path_rate: {type: categorical, choices: [0.0, 0.1]}
"""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from vitflow.config import DEFAULT_PRESET, all_keys, build_config, model_key_defaults
from vitflow.metrics import canonical_key, split_metric
from vitflow.models import config_class
from vitflow.training.callbacks import Callback

log = logging.getLogger(__name__)

SETTINGS, STORAGE, TABLE, BEST = "sweep.json", "sweep.db", "sweep.csv", "best.yaml"
TYPES = ("float", "int", "categorical")


class SweepError(ValueError):
    """The sweep cannot run as asked; the message names the file, key or option."""


class SweepInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped a trial; the sweep continues when the same command runs again."""


def default_direction(metric: str) -> str:
    """``minimize`` for a figure the metric table says is better lower (``val_loss``, ``val_ece``),
    else ``maximize``."""
    found = split_metric(metric)
    return "minimize" if found and found[1].better == "min" else "maximize"


def read_space(path: str | Path) -> dict[str, dict[str, Any]]:
    """The search space of a YAML file: config key -> ``{type: float|int, low, high[, log, step]}``
    or ``{type: categorical, choices: [...]}``.

    Raises:
        SweepError: unreadable file, unknown config key, unknown type or bad bounds (naming the key).
    """
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"--space {path}: {e}") from None
    if not isinstance(tree, dict) or not tree:
        raise SweepError(f"--space {path}: expected a mapping of config keys to distributions")
    keys = set(all_keys()) | {f"model.{k}" for k in model_key_defaults()}  # (every family's model keys)
    for key, spec in tree.items():
        where = f"--space {path}: {key}"
        if key not in keys:
            raise SweepError(f"{where}: not a config key (see `vitflow train --print-config`)")
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise SweepError(f"{where}: needs type: float, int or categorical")
        if spec["type"] == "categorical":
            if not isinstance(spec.get("choices"), list) or not spec["choices"]:
                raise SweepError(f"{where}: a categorical needs a non-empty list of choices")
        elif not (isinstance(spec.get("low"), (int, float)) and isinstance(spec.get("high"), (int, float))
                  and spec["low"] < spec["high"]) or (spec.get("log") and spec["low"] <= 0):
            raise SweepError(f"{where}: needs numbers low < high (and low > 0 with log: true)")
    return tree


def _suggest(trial, space: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The trial's values of ``space`` (fixed ones for a trial that runs again)."""
    values = {}
    for key, spec in space.items():
        if spec["type"] == "categorical":
            values[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec["type"] == "int":
            values[key] = trial.suggest_int(key, int(spec["low"]), int(spec["high"]), step=int(spec.get("step", 1)),
                                            log=bool(spec.get("log", False)))
        else:
            values[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), step=spec.get("step"),
                                              log=bool(spec.get("log", False)))
    return values


class Pruning(Callback):
    """A trial's callback: reports the metric (``split``'s ``key``) of each evaluation during
    training to the Optuna trial and stops a trial the pruner prunes (after a ``pruned`` record in
    its run's metrics).

    Raises:
        optuna.TrialPruned: the pruner stops the trial.
        SweepError: the run does not evaluate ``split`` during training.
    """

    def __init__(self, trial, metric: str):
        self.trial, self.metric = trial, metric
        self.split, _, self.key = canonical_key(metric).partition("_")

    def on_evaluation(self, trainer, split: str, result: dict[str, Any]) -> None:
        import optuna

        monitored = trainer.evaluator.monitored
        if split != monitored or trainer.finishing:  # the evaluations during training
            return
        if self.split != monitored:
            raise SweepError(f"--metric {self.metric}: the runs evaluate {monitored} during training, not "
                             f"{self.split} (set data.val_split, or choose --metric {monitored}_{self.key})")
        value = result.get(self.key)
        if value is None:
            raise SweepError(f"--metric {self.metric}: the evaluations have no {self.key!r} (they have "
                             f"{', '.join(k for k, v in result.items() if isinstance(v, (int, float)))})")
        self.trial.report(float(value), trainer.step)
        if self.trial.should_prune():
            trainer.metrics.write("pruned", step=trainer.step, metric=self.metric, value=float(value))
            raise optuna.TrialPruned(f"at step {trainer.step} ({self.metric} {value:.4g})")


def _open_folder(sweep_dir: Path, settings: dict[str, Any]) -> None:
    """Create the sweep folder, or check that it holds this sweep.

    Raises:
        SweepError: the folder holds another sweep, or files that are not a sweep's.
    """
    saved = sweep_dir / SETTINGS
    if saved.is_file():
        old = json.loads(saved.read_text())
        changed = [k for k in settings if old.get(k) != settings[k]]
        if changed:
            raise SweepError(f"--dir {sweep_dir} holds another sweep (different {', '.join(changed)}): re-run it "
                             "with the same options to continue it, or choose another --dir")
        return
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise SweepError(f"--dir {sweep_dir} is not empty and holds no sweep ({SETTINGS}): choose another --dir")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(settings, indent=1))


def _study(sweep_dir: Path, direction: str, seed: int, prune_after: int):
    """The sweep's Optuna study (created or loaded); trials a killed process left running are
    marked failed and their values queued to run again."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{(sweep_dir / STORAGE).resolve()}")
    study = optuna.create_study(study_name="sweep", storage=storage, direction=direction, load_if_exists=True,
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=prune_after))
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        log.warning("trial %d was left running by an interrupted sweep: marked failed, its values run again",
                    t.number)
        storage.set_trial_user_attr(t._trial_id, "interrupted", True)
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
    # seeded by the trials so far: a resumed sweep draws as the same sweep would from that state
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.trials))
    return study


def finished(study) -> int:
    """Trials that count towards ``--trials``: complete, pruned, or failed on an error (not the
    interrupted ones, which run again)."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(t.state in done and not t.user_attrs.get("interrupted") for t in study.trials)


def run_sweep(space_file: str | Path, trials: int, sweep_dir: str | Path | None = None, preset: str | None = None,
              config_file: str | None = None, overrides: Sequence[str] = (), metric: str = "val_top1",
              direction: str | None = None, seed: int = 0, prune_after: int = 3,
              checks: Mapping[str, Callable] | None = None, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or continue) a sweep to ``trials`` finished trials; see the module docstring.

    Args:
        space_file: the search space (:func:`read_space`).
        sweep_dir: the sweep folder (default ``sweeps/<preset>-<space file name>``).
        metric: the objective, a figure of the run summary (``val_top1``, ``val_loss``, ``test_top1``...).
        direction: ``maximize`` / ``minimize`` (default: :func:`default_direction`).
        prune_after: trials that run to the end before the median rule prunes any.
        checks: the layers' config checks (as :func:`vitflow.config.build_config` takes them).
    Returns:
        ``sweep_dir``, ``trials`` (finished), ``complete``, ``pruned``, ``failed``, ``best`` (trial,
        value, params, run_dir; ``None`` before a trial completes), ``table``, ``best_config``.
    Raises:
        SweepError: a bad space file, metric or folder; SweepInterrupted: a signal stopped a trial.
    """
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SweepError("vitflow sweep needs the optuna package: pip install 'vitflow[sweep]'") from None
    space = read_space(space_file)
    direction = direction or default_direction(metric)
    preset = preset or DEFAULT_PRESET
    sweep_dir = Path(sweep_dir or Path("sweeps") / f"{preset}-{Path(space_file).stem}")
    settings = {"preset": preset, "config": config_file, "space": space, "overrides": list(overrides),
                "metric": metric, "direction": direction, "seed": seed}
    _open_folder(sweep_dir, settings)
    study = _study(sweep_dir, direction, seed, prune_after)
    base = dict(preset=preset, config_file=config_file, overrides=list(overrides), checks=checks)
    while finished(study) < trials:
        _run_trial(study, space, base, sweep_dir, metric, echo)
    return _summary(study, sweep_dir, metric, direction)


def _run_trial(study, space: Mapping[str, dict[str, Any]], base: dict[str, Any], sweep_dir: Path, metric: str,
               echo: Callable[[str], None]) -> None:
    """Ask, train, tell one trial; then rewrite the table and the best config."""
    import optuna
    from optuna.trial import TrialState

    from vitflow.training.loop import Trainer

    trial, started = study.ask(), time.perf_counter()
    run_dir = sweep_dir / f"trial-{trial.number:04d}"
    trial.set_user_attr("run_dir", str(run_dir))
    state, value, note, assigned = TrialState.FAIL, None, "", []
    try:
        values = _suggest(trial, space)
        assigned = [f"{k}={json.dumps(v)}" for k, v in values.items()]
        cfg = build_config(base["preset"], base["config_file"], [*base["overrides"], *assigned,
                                                                  f"train.run_dir={run_dir}"], checks=base["checks"],
                           model_config=config_class)
        trainer = Trainer(cfg, [Pruning(trial, metric)])
        summary = trainer.fit()
        if "interrupted" in summary:
            note = f"{summary['interrupted']} at step {summary['step']}"
            raise SweepInterrupted(f"{summary['interrupted']}: trial {trial.number} stopped at step "
                                   f"{summary['step']} (it runs again when the sweep continues)")
        if canonical_key(metric) not in summary:
            raise SweepError(f"--metric {metric}: not among the run's figures ({', '.join(_figures(summary))})")
        state, value = TrialState.COMPLETE, float(summary[canonical_key(metric)])
    except optuna.TrialPruned as e:
        state, note = TrialState.PRUNED, str(e)
    except (SweepInterrupted, KeyboardInterrupt):
        trial.set_user_attr("interrupted", True)
        study.enqueue_trial(trial.params, skip_if_exists=False)
        raise
    except SweepError:
        raise
    except Exception as e:  # a diverged or refused configuration: recorded, the sweep goes on
        note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("trial %d failed: %s", trial.number, note)
    finally:
        trial.set_user_attr("seconds", round(time.perf_counter() - started, 1))
        trial.set_user_attr("note", note)
        study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        write_table(study, sweep_dir / TABLE)
        write_best(study, sweep_dir / BEST, metric)
    shown = f"{metric} {value:.4g}" if value is not None else note
    echo(f"trial {trial.number}: {state.name.lower()} {shown}  {', '.join(assigned)}  ({run_dir})")


def _figures(summary: dict[str, Any]) -> list[str]:
    return [k for k, v in summary.items() if isinstance(v, (int, float)) and "_" in k and k.split("_")[0]
            in ("val", "test")]


def write_table(study, path: Path) -> None:
    """``sweep.csv``: one row per trial (trial, state, value, the sampled keys, run_dir, seconds,
    note), written whole and renamed into place."""
    trials = study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "state", "value", *keys, "run_dir", "seconds", "note"])
        for t in trials:
            note = t.user_attrs.get("note", "") or ("interrupted" if t.user_attrs.get("interrupted") else "")
            w.writerow([t.number, t.state.name.lower(), "" if t.value is None else t.value,
                        *[t.params.get(k, "") for k in keys], t.user_attrs.get("run_dir", ""),
                        t.user_attrs.get("seconds", ""), note])
    tmp.replace(path)


def _best(study):
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def write_best(study, path: Path, metric: str) -> Path | None:
    """``best.yaml``: the best trial's full config (its run's ``config.yaml`` without the run
    directory), loadable with ``vitflow train --config best.yaml``; ``None`` before a trial completes."""
    best = _best(study)
    if best is None:
        return None
    tree = yaml.safe_load((Path(best.user_attrs["run_dir"]) / "config.yaml").read_text())
    tree["train"].update(run_dir=None, resume="none")
    head = (f"# best of {len(study.trials)} trials: trial {best.number}, {metric} = {best.value:.6g} "
            f"({study.direction.name.lower()})\n# " + ", ".join(f"{k}={v}" for k, v in best.params.items()) +
            f"\n# its run: {best.user_attrs['run_dir']}\n# train it: vitflow train --config {path} (a longer budget: "
            "train.total_steps=N or train.time_budget=T)\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(head + yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)
    return path


def _summary(study, sweep_dir: Path, metric: str, direction: str) -> dict[str, Any]:
    from optuna.trial import TrialState

    counted = {s: sum(t.state == s and not t.user_attrs.get("interrupted") for t in study.trials)
               for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    best = _best(study)
    return {"sweep_dir": str(sweep_dir), "metric": metric, "direction": direction, "trials": finished(study),
            "complete": counted[TrialState.COMPLETE], "pruned": counted[TrialState.PRUNED],
            "failed": counted[TrialState.FAIL], "table": str(sweep_dir / TABLE),
            "best_config": str(sweep_dir / BEST) if best else None,
            "best": {"trial": best.number, "value": best.value, "params": best.params,
                     "run_dir": best.user_attrs["run_dir"]} if best else None}
