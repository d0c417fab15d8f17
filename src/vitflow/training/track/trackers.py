"""Experiment trackers, a callback of the run (:class:`Trackers`): MLflow and Weights & Biases.

Each is switched on by one key and is an optional extra (``pip install 'vitflow[mlflow]'``,
``'vitflow[wandb]'``):

- ``train.mlflow=true`` (``./mlruns``), ``=FOLDER`` or ``=file:FOLDER`` (MLflow's file store in that
  folder), or ``=URI`` (a tracking server ``http(s)://HOST:PORT``, ``sqlite:///mlflow.db``, ...);
  ``train.mlflow_experiment`` names the experiment (default: the preset's name);
- ``train.wandb=online|offline|auto`` (auto: ``WANDB_MODE``, else online); ``train.wandb_project``
  names the project (default: ``WANDB_PROJECT``, else the preset's name). Offline runs are written
  to ``WANDB_DIR/wandb/offline-run-*`` (default ``./wandb``), to upload later with ``wandb sync``.

What each gets: the flattened config as parameters (``train.batch_size``, ...) at the start; every
``train`` record (``train/loss``, ``train/lr``, ``train/images_per_s``, ...) and ``eval`` record
(``SPLIT/top1``, ``SPLIT/loss``, ... with ``SPLIT`` the record's split: ``val``, ``test``) at its
step, as MetricsLog writes them; at the end ``eval.json``, ``config.yaml``, ``report.html`` and the
report's figures (``report/*.png``) as artifacts (W&B: run files), and the run's end state
(finished, killed by a signal or a sweep's pruning, failed). Only rank 0 of a data-parallel run
opens trackers, so nothing is logged twice. A resumed run continues the same tracker runs (their
ids are kept in ``RUN_DIR/trackers.json``). A tracker that fails during the run is switched off
with one warning: training goes on, and the run directory's own files keep everything.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from vitflow.config import TrainConfig
from vitflow.training.callbacks import Callback

log = logging.getLogger(__name__)

IDS = "trackers.json"  # RUN_DIR/trackers.json: {"mlflow": run id, "wandb": run id}
ARTIFACTS = ("eval.json", "config.yaml", "report.html", "report")  # files and folders logged at the end
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit of parameters in one log_batch
END_STATES = {"summary": "FINISHED", "interrupted": "KILLED", "pruned": "KILLED"}  # last record kind -> state


class TrackerError(ValueError):
    """A tracker cannot start: its package is missing or its server refused; the message names
    the key and what to do."""


class Tracker(Protocol):
    """One tracking backend: what :class:`Trackers` calls (``run_id``: the backend's id of the
    run, kept in ``RUN_DIR/trackers.json`` so that a resume continues it)."""

    name: str
    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_artifact(self, path: Path, name: str) -> None: ...

    def close(self, state: str) -> None: ...


def mlflow_uri(value: str | None) -> str | None:
    """``train.mlflow`` as a tracking URI, or ``None`` when off (unset, ``false``, ``none``):
    ``true`` -> ``file:`` URI of ``./mlruns``; a folder or ``file:`` URI -> the absolute ``file:``
    URI; any other ``scheme:...`` as it is."""
    if value is None or str(value).strip().lower() in ("", "false", "none", "off", "no"):
        return None
    text = str(value).strip()
    if text.lower() in ("true", "on", "yes"):
        text = "mlruns"
    if text.startswith("file:"):
        text = text[5:].removeprefix("//")
    elif ":" in text.split("/")[0]:  # http://, https://, sqlite:///, databricks, ...
        return text
    return Path(text).expanduser().resolve().as_uri()


def enabled(t: TrainConfig) -> list[str]:
    """The trackers the ``train`` section switches on (``"mlflow"``, ``"wandb"``)."""
    return [name for name, on in (("mlflow", mlflow_uri(t.mlflow)), ("wandb", t.wandb != "none")) if on]


def check_trackers(t: TrainConfig) -> None:
    """Fail before any work when a tracker is switched on but its package is not installed.

    Raises:
        TrackerError: ``train.mlflow`` without ``mlflow`` / ``train.wandb`` without ``wandb``.
    """
    for name in enabled(t):
        if importlib.util.find_spec(name) is None:
            raise TrackerError(f"train.{name} is set but the {name} package is not installed: "
                               f"pip install 'vitflow[{name}]'")


def open_trackers(t: TrainConfig, params: dict[str, Any], name: str, run_dir: Path, resume: bool) -> "Trackers | None":
    """Start the trackers the ``train`` section switches on (``None`` when none is): each creates
    its run (or, when ``resume`` and ``RUN_DIR/trackers.json`` names one, continues it) and logs
    ``params`` (the flattened config) as parameters; ``name``: the preset, the default experiment /
    project name. Call it on rank 0 only.

    Raises:
        TrackerError: a package is missing, or the tracking server / store refuses the run.
    """
    names = enabled(t)
    if not names:
        return None
    check_trackers(t)
    ids = _read_ids(run_dir) if resume else {}
    opened: list[Tracker] = []
    for kind in names:
        try:
            tracker = (_mlflow if kind == "mlflow" else _wandb)(t, name, run_dir, ids.get(kind))
            if kind not in ids:
                tracker.log_params(params)
        except TrackerError:
            raise
        except Exception as e:  # the package's own errors: a server down, a store unreadable
            for t in opened:
                t.close("FAILED")
            key = f"train.{kind}={t.mlflow if kind == 'mlflow' else t.wandb}"
            raise TrackerError(f"{key}: the tracker could not start a run: {_one_line(e)}") from None
        opened.append(tracker)
    return Trackers(opened, run_dir)


class Trackers(Callback):
    """Fans the run's records out to the trackers (a callback: :meth:`on_record`, :meth:`on_fit_end`).

    :meth:`record` takes every record the run writes: ``train`` and ``eval`` records with a
    ``step`` become metrics (their numbers, but ``time``, ``step`` and ``epoch``) named
    ``train/KEY`` and ``SPLIT/KEY``; :meth:`close` logs the run's files (:data:`ARTIFACTS`)
    and ends the tracker runs in the state the last record tells (:data:`END_STATES`; else
    ``FAILED``)."""

    def __init__(self, trackers: list[Tracker], run_dir: Path):
        self.trackers, self.run_dir, self.last_kind, self._saved = list(trackers), Path(run_dir), None, False

    def record(self, rec: dict[str, Any]) -> None:
        if not self._saved and self.run_dir.is_dir():  # the ids, once the run directory exists
            ids = {t.name: t.run_id for t in self.trackers}
            (self.run_dir / IDS).write_text(json.dumps(ids))
            self._saved = True
        self.last_kind = rec.get("kind")
        if rec.get("kind") not in ("train", "eval") or "step" not in rec:
            return
        prefix = "train" if rec["kind"] == "train" else rec.get("split") or "eval"
        metrics = {f"{prefix}/{k}": float(v) for k, v in rec.items() if k not in ("time", "kind", "step", "epoch")
                   and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if metrics:
            self._each(lambda t: t.log_metrics(int(rec["step"]), metrics))

    def on_record(self, trainer, record: dict[str, Any]) -> None:
        self.record(record)

    def on_fit_end(self, trainer, summary: dict[str, Any] | None) -> None:
        self.close()

    def close(self) -> None:
        """Log the run's files, then end every tracker run."""
        for name in ARTIFACTS:
            path = self.run_dir / name
            if path.exists():
                self._each(lambda t: t.log_artifact(path, name))
        state = END_STATES.get(self.last_kind, "FAILED")
        self._each(lambda t: t.close(state))
        self.trackers = []

    def _each(self, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:  # training goes on; the run directory has every record
                log.warning("%s failed (%s); it is off for the rest of this run (the run directory keeps "
                            "every record)", tracker.name, _one_line(e))
                self.trackers.remove(tracker)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / IDS).read_text())
    except (OSError, ValueError):
        return {}


class MLflowTracker:
    """A run in an MLflow tracking store or server (``mlflow.tracking.MlflowClient``: no global
    state, so several runs in one process, e.g. a sweep's trials, stay apart)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None = None,
                 tags: dict[str, str] | None = None):
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch; the user chose it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags or {}).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_PARAMS_PER_CALL])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_artifact(self, path: Path, name: str) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
        else:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, state: str) -> None:
        self.client.set_terminated(self.run_id, status=state)


def _mlflow(t: TrainConfig, name: str, run_dir: Path, run_id: str | None) -> MLflowTracker:
    uri = mlflow_uri(t.mlflow)
    tracker = MLflowTracker(uri, t.mlflow_experiment or name, run_dir.name, run_id,
                            {"vitflow.run_dir": str(run_dir.resolve()), "vitflow.preset": name})
    log.info("MLflow: run %s in %s", tracker.run_id, uri)
    return tracker


class WandbTracker:
    """A Weights & Biases run (online, or offline: a local run folder ``wandb sync`` uploads)."""

    name = "wandb"

    def __init__(self, mode: str, project: str, run_name: str, config: dict[str, Any], run_id: str | None = None):
        import wandb

        settings = wandb.Settings(console="off")  # vitflow's own output stays as it is (--json on stdout)
        self.run = wandb.init(project=project, name=run_name, config=config, id=run_id,
                              resume="allow" if run_id else None, mode=None if mode == "auto" else mode,
                              settings=settings, reinit="finish_previous")
        self.run_id, self.offline = self.run.id, self.run.offline

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_artifact(self, path: Path, name: str) -> None:
        """Copied into the run's files (so an offline folder is complete without the run directory)."""
        target = Path(self.run.dir) / name
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)

    def close(self, state: str) -> None:
        self.run.finish(exit_code=0 if state == "FINISHED" else 1)  # offline: wandb names the folder to sync


def _wandb(t: TrainConfig, name: str, run_dir: Path, run_id: str | None) -> WandbTracker:
    project = t.wandb_project or os.environ.get("WANDB_PROJECT") or name
    return WandbTracker(t.wandb, project, run_dir.name, {}, run_id)
