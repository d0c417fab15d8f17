"""Where a sweep's trials live, shared by every worker: an Optuna relational storage (SQLite in the
sweep folder by default; PostgreSQL or MySQL for several machines) with heartbeats.

Each running trial's worker records a heartbeat every ``heartbeat`` seconds (:class:`Heartbeat`);
a running trial whose heartbeat is older than :data:`GRACE` heartbeats belongs to a worker that
died (SIGKILL, a lost machine): any worker fails it (Optuna's ``fail_stale_trials``, at each of
its own beats and before each trial it asks for, so within ``GRACE + 1`` beats of the death) and
:class:`Retry` queues its values again, to continue from its run's last checkpoint. A live
trial is never touched, whoever started it (Optuna's heartbeat monitoring, ``RDBStorage``).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from vitflow.training.sweep.space import SweepError

log = logging.getLogger(__name__)

HEARTBEAT_S = 10  # seconds between a running trial's heartbeats
GRACE = 3  # heartbeats missed before a running trial counts as its worker's death
DRIVERS = {"postgresql": "'psycopg[binary]'", "mysql": "pymysql, with a mysql+pymysql:// URL"}


def shown(url: str) -> str:
    """``url`` with its password hidden (for messages and ``sweep.json``)."""
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return url


class Retry:
    """Optuna's heartbeat-stale callback: a trial whose worker died is queued again (its values,
    ``resume`` = its run folder, ``retries`` + 1) while it has had fewer than ``max_retry`` retries."""

    def __init__(self, max_retry: int):
        self.max_retry = max_retry

    def __call__(self, study, trial) -> None:
        retries = int(trial.user_attrs.get("retries", 0))
        log.warning("trial %d: its worker stopped sending heartbeats (killed or lost): failed%s", trial.number,
                    f", run again from its last checkpoint (retry {retries + 1} of {self.max_retry})"
                    if retries < self.max_retry else f" (it had its {self.max_retry} retries)")
        if retries < self.max_retry:
            study.enqueue_trial(trial.params, user_attrs={"resume": trial.user_attrs.get("run_dir", ""),
                                                          "retry_of": trial.number, "retries": retries + 1},
                                skip_if_exists=False)


def open_storage(url: str, heartbeat: int = HEARTBEAT_S, retry: int = 1):
    """Optuna's ``RDBStorage`` of ``url`` with heartbeats every ``heartbeat`` s, a grace of
    :data:`GRACE` of them, and :class:`Retry` (``retry`` times) for trials whose worker died.

    Raises:
        SweepError: not a database URL, no driver for it, the server unreachable or refusing, a
            database holding other tables, or one that is not an Optuna storage of this version (one
            line, password hidden; nothing written).
    """
    import optuna
    import sqlalchemy

    try:
        kind = sqlalchemy.engine.make_url(url).get_backend_name()
    except sqlalchemy.exc.ArgumentError:
        raise SweepError(f"--storage {url}: not a database URL (postgresql://USER:PASSWORD@HOST:PORT/DB, "
                         "mysql+pymysql://..., sqlite:///FILE)") from None
    timeout = {"sqlite": {"timeout": 60}, "postgresql": {"connect_timeout": 10}, "mysql": {"connect_timeout": 10}}
    where = f"--storage {shown(url)}"
    try:
        _refuse_foreign_tables(url, {"connect_args": timeout.get(kind, {})}, where)
        for attempt in range(3):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": timeout.get(kind, {})},
                                                      heartbeat_interval=heartbeat, grace_period=GRACE * heartbeat,
                                                      heartbeat_stale_trial_callback=Retry(retry))
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):  # workers creating a new
                # database's tables at the same moment (a duplicate type or table)
                if attempt == 2:
                    raise
                time.sleep(0.5 + attempt)
    except ImportError:
        raise SweepError(f"{where}: no {kind} driver here (pip install {DRIVERS.get(kind, 'its SQLAlchemy driver')})"
                         ) from None
    except sqlalchemy.exc.NoSuchModuleError:
        raise SweepError(f"{where}: {kind!r} is not a database SQLAlchemy knows (postgresql, mysql, sqlite)") from None
    except sqlalchemy.exc.OperationalError as e:
        raise SweepError(f"{where}: cannot open it: {_first_line(e.orig or e)}") from None
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError) as e:  # another schema, or another Optuna version's
        raise SweepError(f"{where}: not an Optuna storage this version can use: {_first_line(e)}") from None


def _refuse_foreign_tables(url: str, engine_kwargs: dict, where: str) -> None:
    """A database that holds tables, none of them Optuna's, is someone else's: Optuna would add
    its own beside them. Raises SweepError naming a few of them (nothing written)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        tables = sorted(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if tables and "studies" not in tables:
        raise SweepError(f"{where}: holds tables that are not an Optuna storage's ({', '.join(tables[:3])}"
                         f"{', ...' if len(tables) > 3 else ''}): name an empty database or a sweep's")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def open_study(storage, name: str, settings: dict[str, Any], direction: str, prune_after: int):
    """The study ``name`` in ``storage`` (created, or joined), holding ``settings`` (the search's
    space, metric, preset and overrides) as its ``vitflow_sweep`` attribute.

    Raises:
        SweepError: the study holds another search (the message names what differs).
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, load_if_exists=True,
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=prune_after))
    saved = study.user_attrs.get("vitflow_sweep")
    if saved is None:  # a new study, or an earlier vitflow's sweep folder (its sweep.json was checked)
        study.set_user_attr("vitflow_sweep", settings)
    elif changed := [k for k in settings if saved.get(k) != settings[k]]:
        raise SweepError(f"study {name!r} in the storage is another search (different {', '.join(changed)}): run it "
                         "with the same options to join it, or name another --study")
    _requeue_legacy(study)
    return study


def _requeue_legacy(study) -> None:
    """A running trial of an earlier vitflow (no heartbeat, no ``worker``) left by a killed sweep:
    failed and its values queued again (grace: one :data:`GRACE` period since it started)."""
    from optuna.trial import TrialState

    storage = study._storage
    limit = dt.datetime.now() - dt.timedelta(seconds=GRACE * storage.get_heartbeat_interval())
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "worker" not in t.user_attrs and t.datetime_start and t.datetime_start < limit:
            log.warning("trial %d was left running by an interrupted sweep: marked failed, its values run again",
                        t.number)
            storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)


class Heartbeat:
    """A thread recording trial ``trial_id``'s heartbeat every heartbeat interval while the block
    runs (the first at once), and at each beat failing the study's trials whose worker died, so
    that a dead worker's trial is found within :data:`GRACE` + 1 beats however long the live
    workers' trials are. A failed write is logged, not raised: the trial goes on, and is failed by
    another worker only if the storage stays out of reach."""

    def __init__(self, study, trial_id: int):
        self.study, self.storage, self.trial_id = study, study._storage, trial_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"sweep-heartbeat-{trial_id}", daemon=True)

    def _beat(self) -> None:
        import optuna

        while True:
            try:
                self.storage.record_heartbeat(self.trial_id)
                optuna.storages.fail_stale_trials(self.study)
            except Exception as e:  # the storage out of reach for a moment
                log.warning("sweep heartbeat: %s", _first_line(e))
            if self._stop.wait(self.storage.get_heartbeat_interval()):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Tally:
    """Trials by what they mean for ``--trials``: ``finished`` count (complete, pruned, failed on
    an error); ``running`` are live or not yet found dead; the others (interrupted, lost with their
    worker, surplus) are not counted."""

    finished: int
    running: int


def counted(t) -> bool:
    """Whether finished trial ``t`` counts towards ``--trials``: it ran to an end in a worker (its
    ``seconds`` recorded), not stopped by a signal (its values run again) nor surplus."""
    from optuna.trial import TrialState

    return (t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) and "seconds" in t.user_attrs
            and not t.user_attrs.get("interrupted") and not t.user_attrs.get("surplus"))


def tally(study) -> Tally:
    """The study's :class:`Tally`, after failing the trials whose worker died (heartbeat)."""
    import optuna
    from optuna.trial import TrialState

    optuna.storages.fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    return Tally(sum(counted(t) for t in trials), sum(t.state == TrialState.RUNNING for t in trials))


def surplus(study, number: int, trials: int) -> bool:
    """Whether trial ``number`` (just asked for) is past ``--trials``: as many trials before it are
    already finished (counted) or running. Trial numbers are given out in order by the storage, so
    of two workers asking at once only the later one sees the other's."""
    from optuna.trial import TrialState

    before = [t for t in study.get_trials(deepcopy=False) if t.number < number]
    return sum(counted(t) or t.state == TrialState.RUNNING for t in before) >= trials


def draws_before(study, number: int) -> int:
    """The trials before trial ``number`` whose values the sampler drew: not the ones that run an
    earlier trial's values again (``retry_of``), nor surplus ones. Seeding trial ``number`` by it,
    a lone worker stopped and continued proposes what it would have without the stop."""
    return sum(t.number < number and "retry_of" not in t.user_attrs and not t.user_attrs.get("surplus")
               for t in study.get_trials(deepcopy=False))
