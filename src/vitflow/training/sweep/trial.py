"""One trial of a sweep in this process: its run folder (new, or the folder of the trial it
continues), the Trainer with the pruning callback, its heartbeat, and what it tells the storage."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from vitflow.config import build_config
from vitflow.metrics import canonical_key
from vitflow.models import config_class
from vitflow.training.callbacks import Callback
from vitflow.training.sweep.records import BEST, TABLE, write_best, write_table
from vitflow.training.sweep.space import SweepError, suggest
from vitflow.training.sweep.storage import Heartbeat

log = logging.getLogger(__name__)


class SweepInterrupted(RuntimeError):
    """SIGINT/SIGTERM stopped a trial; its values run again (from its checkpoint) when a worker of
    the sweep goes on."""


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


def _run_dir(trial, sweep_dir: Path) -> tuple[Path, bool]:
    """The trial's run folder and whether it continues one: the folder of the trial it runs again
    (interrupted, or its worker lost) where that folder is on this machine, else its own."""
    earlier = trial.user_attrs.get("resume")
    if earlier and Path(earlier).is_dir():
        return Path(earlier), True
    if earlier:
        log.warning("trial %d runs trial %s's values again, whose run folder %s is not on this machine: it starts "
                    "over", trial.number, trial.user_attrs.get("retry_of", "?"), earlier)
    return sweep_dir / f"trial-{trial.number:04d}", False


def run_trial(study, trial, space: Mapping[str, dict[str, Any]], base: dict[str, Any], sweep_dir: Path,
              metric: str, echo: Callable[[str], None]) -> None:
    """Train one asked trial with its heartbeat running, tell the storage how it ended, and
    rewrite the table and the best config. ``base``: preset, config_file, overrides, checks and
    ``threads`` (``train.threads`` of the trial unless the overrides set it).

    Raises:
        SweepInterrupted: a signal stopped it (its values are queued again, to resume its folder);
        SweepError: the metric is not one the runs give.
    """
    import optuna
    from optuna.trial import TrialState

    from vitflow.training.loop import Trainer

    started = time.perf_counter()
    run_dir, again = _run_dir(trial, sweep_dir)
    trial.set_user_attr("run_dir", str(run_dir))
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    state, value, note, assigned = TrialState.FAIL, None, "", []
    extra = [f"train.run_dir={run_dir}", *(["train.resume=auto"] if again else [])]
    if base.get("threads") and not any(o.startswith("train.threads=") for o in base["overrides"]):
        extra.append(f"train.threads={base['threads']}")
    try:
        with Heartbeat(study, trial._trial_id):
            values = suggest(trial, space)
            assigned = [f"{k}={json.dumps(v)}" for k, v in values.items()]
            cfg = build_config(base["preset"], base["config_file"], [*base["overrides"], *assigned, *extra],
                               checks=base["checks"], model_config=config_class)
            summary = Trainer(cfg, [Pruning(trial, metric)]).fit()
        if "interrupted" in summary:
            note = f"{summary['interrupted']} at step {summary['step']}"
            raise SweepInterrupted(f"{summary['interrupted']}: trial {trial.number} stopped at step "
                                   f"{summary['step']} (it goes on from there when the sweep goes on)")
        if canonical_key(metric) not in summary:
            raise SweepError(f"--metric {metric}: not among the run's figures ({', '.join(_figures(summary))})")
        state, value = TrialState.COMPLETE, float(summary[canonical_key(metric)])
        trial.set_user_attr("config", (run_dir / "config.yaml").read_text())
    except optuna.TrialPruned as e:
        state, note = TrialState.PRUNED, str(e)
    except (SweepInterrupted, KeyboardInterrupt):
        trial.set_user_attr("interrupted", True)
        study.enqueue_trial(trial.params, user_attrs={"resume": str(run_dir), "retry_of": trial.number},
                            skip_if_exists=False)
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
