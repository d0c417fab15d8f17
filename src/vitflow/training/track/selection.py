"""Checkpoint selection and early stopping on an evaluated figure.

``train.keep_best=SPLIT_METRIC`` (``val_top1``, ``val_loss``, ``val_f1``, ``NAME_balanced_accuracy``
for a ``data.evals`` split, ...) keeps the checkpoint of the best evaluation so far as
``RUN_DIR/checkpoints/best.pt``, beside the newest ``train.keep_checkpoints`` (rotation never
removes it). Whether higher or lower is better is the metric table's
(:data:`vitflow.metrics.METRICS`, :attr:`~vitflow.metrics.Metric.better`: loss and ECE lower,
the rest higher); a tie keeps the earlier checkpoint. :func:`check_config` refuses a name the
table does not know when the config is built (the CLI passes it to ``build_config``).

Early stopping (``train.early_stopping_patience`` evaluations without an improvement of more than
``train.early_stopping_min_delta`` in ``train.early_stopping_metric``, default the keep_best
metric) ends the run after that evaluation, as Keras' and Lightning's ``EarlyStopping`` do. Its
counter travels in the checkpoint (:meth:`Selection.state_dict`), so a resumed run stops at the
step of an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vitflow.config import ConfigError
from vitflow.config.schema import TrainConfig
from vitflow.metrics import Metric, selectable_names, split_metric
from vitflow.training.callbacks import Callback

log = logging.getLogger(__name__)


def _selected(name: str, key: str) -> tuple[str, Metric]:
    """``(split, metric)`` of ``SPLIT_METRIC`` ``name`` set as ``key``; raises :class:`ConfigError`
    (naming the key, the metrics allowed and an example) unless the table has such a metric with
    a direction."""
    found = split_metric(name)
    if found is None or found[1].better is None:
        raise ConfigError(f"{key}={name!r} is not a known metric: use SPLIT_METRIC with SPLIT val, test or a "
                          f"data.evals name and METRIC one of {', '.join(selectable_names())} (e.g. val_top1)", key)
    return found


def check_config(t: TrainConfig) -> None:
    """The train section's check that needs the metric table: ``train.keep_best`` and
    ``train.early_stopping_metric`` name a known metric after a split prefix (``val_top1``,
    ``NAME_loss``); which splits exist is checked when the run starts (:func:`parse_metric`).

    Raises:
        ConfigError: naming the key, the metrics allowed and an example.
    """
    for key in ("keep_best", "early_stopping_metric"):
        if getattr(t, key) is not None:
            _selected(getattr(t, key), f"train.{key}")


def parse_metric(name: str, splits: list[str], key: str = "train.keep_best") -> tuple[str, str, str]:
    """``"val_top1"`` -> ``(split "val", figure "top1", mode "max")``; an alias gives its
    metric's name (``val_f1`` -> ``macro_f1``).

    Args:
        splits: the splits evaluated during training (the monitored role and the data.evals names).
        key: the config key that set ``name``, for the error message.
    Raises:
        ConfigError: an unknown figure, or a split not evaluated during training (naming them).
    """
    split, metric = _selected(name, key)
    if split not in splits:
        raise ConfigError(f"train.keep_best / early_stopping_metric={name}: the split {split!r} is not "
                          f"evaluated during training (evaluated: {', '.join(splits)}; add a validation split "
                          "with data.val_split, or a named one with data.evals)", "train.keep_best")
    return split, metric.name, metric.better


class Selection(Callback):
    """The best-checkpoint and early-stopping decisions of a run, a callback: after each evaluation
    of the monitored split it writes ``best.pt`` when the figure improved and asks the run to stop
    when early stopping fires; its counters travel in checkpoints (``selection``).

    Args:
        keep_best: the figure ``best.pt`` is chosen by, or ``None``.
        patience: evaluations without improvement that stop the run (0 = never).
        min_delta: the least change counted as an improvement (units of the figure).
        stop_metric: the figure early stopping watches (default ``keep_best``).
        splits: the splits evaluated during training (see :func:`parse_metric`).
        state: a checkpoint's :meth:`state_dict`, for a resumed run.
    Raises:
        ConfigError: see :func:`parse_metric`.
    """

    def __init__(self, keep_best: str | None, patience: int, min_delta: float, stop_metric: str | None,
                 splits: list[str], state: dict[str, Any] | None = None):
        self.keep = parse_metric(keep_best, splits) if keep_best else None
        key = "train.early_stopping_metric" if stop_metric else "train.keep_best"
        stop_metric = stop_metric or keep_best
        self.watch = parse_metric(stop_metric, splits, key) if patience and stop_metric else None
        self.names = {"keep": keep_best, "stop": stop_metric}
        self.patience, self.min_delta = patience, min_delta
        self.load_state_dict(state or {})

    state_key = "selection"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state
        self.best, self.best_step = s.get("best"), s.get("best_step")
        self.watched_best, self.bad_evals = s.get("watched_best"), int(s.get("bad_evals", 0))
        self.stopped = s.get("stopped")  # the reason line once early stopping fired

    def on_fit_start(self, trainer) -> None:
        if self.stopped:  # a resumed run that early stopping had ended: only its final evaluation is left
            trainer.request_stop(self.stopped)

    def on_evaluation(self, trainer, split: str, metrics: dict[str, Any]) -> None:
        if split != trainer.evaluator.monitored:
            return
        if self.update(trainer.step, {split: metrics, **trainer.evaluator.named_results}):
            trainer.save(best=True)
        if self.stopped:
            trainer.request_stop(self.stopped)

    @staticmethod
    def _value(figures: dict[str, dict[str, Any]], metric: tuple[str, str, str]) -> float | None:
        value = figures.get(metric[0], {}).get(metric[1])
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)

    def update(self, step: int, figures: dict[str, dict[str, Any]]) -> bool:
        """Take one evaluation (``figures``: split -> its metrics); returns whether it is the new
        best (``best.pt`` to be written). Sets :attr:`stopped` when early stopping fires."""
        is_best = False
        if self.keep and (v := self._value(figures, self.keep)) is not None:
            better = self.best is None or (v > self.best if self.keep[2] == "max" else v < self.best)
            if better:
                self.best, self.best_step, is_best = v, step, True
        if self.watch and (v := self._value(figures, self.watch)) is not None:
            sign = 1 if self.watch[2] == "max" else -1
            if self.watched_best is None or sign * (v - self.watched_best) > self.min_delta:
                self.watched_best, self.bad_evals = v, 0
            else:
                self.bad_evals += 1
            if self.bad_evals >= self.patience and not self.stopped:
                self.stopped = (f"early stopping at step {step}: {self.names['stop']} has not improved by more than "
                                f"{self.min_delta:g} for {self.bad_evals} evaluations (best {self.watched_best:.6g})")
                log.info("%s", self.stopped)
        return is_best

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the best value and its step, early stopping's best and counter."""
        return {"metric": self.names["keep"], "best": self.best, "best_step": self.best_step,
                "stop_metric": self.names["stop"] if self.watch else None, "watched_best": self.watched_best,
                "bad_evals": self.bad_evals, "stopped": self.stopped}

    def summary(self) -> dict[str, Any]:
        """The run summary's part: ``best_metric``, ``best_value``, ``best_step``, ``best_checkpoint``
        (with keep_best) and ``early_stopped`` (the reason line, when early stopping ended the run)."""
        out: dict[str, Any] = {}
        if self.keep:
            out.update(best_metric=self.names["keep"], best_value=self.best, best_step=self.best_step)
        if self.stopped:
            out["early_stopped"] = self.stopped
        return out

