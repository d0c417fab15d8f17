"""Sweeps that many workers share: commands started together on one folder, ``--workers N``, a
real PostgreSQL server as the storage of two commands (as two machines use it), a worker
SIGKILLed mid-trial (failed by heartbeat, run again from its checkpoint), and the bad inputs."""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ENV
from servers_postgres import postgres_server, postgres_url  # noqa: F401  a real server on 127.0.0.1
from vitflow.config import build_config
from vitflow.rundir import read_metrics
from vitflow.training.sweep import SweepError, run_sweep

optuna = pytest.importorskip("optuna")
SPACE = {"optim.lr": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True}}
SPLITS = ["data.train_split=train[:80%]", "data.val_split=train[80%:90%]", "data.test_split=train[90%:]"]
SHORT = ["train.total_steps=20", "train.eval_every=10", "optim.warmup_steps=0", *SPLITS]


def _space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(SPACE))
    return path


def _start(tmp_path: Path, sweep_dir: Path, trials: int, *extra: str, trial=SHORT) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vitflow", "-q", "sweep", "--space", str(_space(tmp_path)), "--trials", str(trials),
           "--dir", str(sweep_dir), "--json", *extra, *trial]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _table(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "sweep.csv") as f:
        return list(csv.DictReader(f))


def _trials(url: str):
    """The study's trials, read as the workers write (SQLite: waiting out their locks as they do)."""
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    return optuna.load_study(study_name="sweep", storage=optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
                             ).get_trials()


def _study_created(db: Path) -> bool:
    """The workers have created the study in ``db`` (read only: polling it while they create its
    tables must not write a schema of its own beside theirs)."""
    if not db.exists():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
            return con.execute("SELECT COUNT(*) FROM studies").fetchone()[0] > 0
    except sqlite3.OperationalError:  # no tables yet, or locked while they are made
        return False


def _whole(run_dir: str) -> dict:
    """A trial's run folder is whole: its config, and its summary (or, pruned, its pruned record)."""
    records = read_metrics(run_dir)
    assert (Path(run_dir) / "config.yaml").is_file()
    return next(r for r in records if r["kind"] in ("summary", "pruned"))


@pytest.mark.slow
def test_two_commands_on_one_folder_share_the_trials(tmp_path):
    sweep_dir = tmp_path / "sweep"
    procs = [_start(tmp_path, sweep_dir, 6, "--prune-after", "6") for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert [r["trials"] for r, _ in results] == [6, 6] and all(r["complete"] == 6 for r, _ in results)
    rows = _table(sweep_dir)
    assert len(rows) == 6 and {row["state"] for row in rows} == {"complete"} and not any(row["note"] for row in rows)
    trials = [t for t in _trials(f"sqlite:///{sweep_dir / 'sweep.db'}") if not t.user_attrs.get("surplus")]
    assert len({t.user_attrs["worker"] for t in trials}) == 2  # both commands ran trials
    assert len({t.params["optim.lr"] for t in trials}) == 6  # and proposed different values
    for row in rows:
        assert float(row["value"]) == pytest.approx(_whole(row["run_dir"])["val_top1"], abs=1e-6)


@pytest.mark.slow
def test_workers_run_trials_at_the_same_time_with_the_cores_split(tmp_path):
    sweep_dir = tmp_path / "sweep"
    r, _ = _finish(_start(tmp_path, sweep_dir, 4, "--workers", "2"))
    assert r["trials"] == 4 and r["workers"] == 2
    trials = sorted((t for t in _trials(f"sqlite:///{sweep_dir / 'sweep.db'}") if not t.user_attrs.get("surplus")),
                    key=lambda t: t.datetime_start)
    assert len(trials) == 4 and len({t.user_attrs["worker"] for t in trials}) == 2
    overlaps = [a.datetime_complete > b.datetime_start for a, b in zip(trials, trials[1:])]
    assert any(overlaps)  # two trials ran at once
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for t in trials:
        assert yaml.safe_load(Path(t.user_attrs["run_dir"], "config.yaml").read_text())["train"]["threads"] == threads


@pytest.mark.slow
def test_a_killed_worker_is_found_by_heartbeat_and_its_trial_resumed_from_its_checkpoint(tmp_path):
    sweep_dir, storage = tmp_path / "sweep", f"sqlite:///{tmp_path / 'sweep' / 'sweep.db'}"
    long = ["train.total_steps=150", "train.eval_every=50", "train.checkpoint_every=10", "optim.warmup_steps=0", *SPLITS]
    options = ["--heartbeat", "1", "--prune-after", "9"]
    victim = _start(tmp_path, sweep_dir, 3, *options, trial=long)
    time.sleep(1.0)
    other = _start(tmp_path, sweep_dir, 3, *options, trial=long)
    deadline, ckpt = time.monotonic() + 300, None
    while ckpt is None and time.monotonic() < deadline:  # the victim's trial has written a checkpoint
        time.sleep(0.2)
        if not _study_created(sweep_dir / "sweep.db"):
            continue
        mine = [t for t in _trials(storage) if t.state.name == "RUNNING"
                and t.user_attrs.get("worker", "").endswith(f":{victim.pid}")]
        if mine:
            found = [p for t in mine for p in Path(t.user_attrs["run_dir"]).glob("checkpoints/*.pt")]
            ckpt = found[0] if found else None
    assert ckpt is not None, "the first command's trial wrote no checkpoint"
    victim.send_signal(signal.SIGKILL)
    killed_at = time.time()
    victim.communicate(timeout=60)
    r, _ = _finish(other)
    assert r["trials"] == 3 and r["failed"] == 0
    trials = _trials(storage)
    lost = [t for t in trials if t.state.name == "FAIL" and "seconds" not in t.user_attrs]
    assert len(lost) == 1 and lost[0].user_attrs["worker"].endswith(f":{victim.pid}")
    assert lost[0].datetime_complete.timestamp() - killed_at < 4 + 4  # failed within 3 + 1 heartbeats (+ load)
    again = [t for t in trials if t.user_attrs.get("retry_of") == lost[0].number]
    assert len(again) == 1 and again[0].state.name == "COMPLETE"
    assert again[0].user_attrs["run_dir"] == lost[0].user_attrs["run_dir"]
    starts = [rec for rec in read_metrics(again[0].user_attrs["run_dir"]) if rec["kind"] == "start"]
    assert starts[0]["step"] == 0 and starts[-1]["step"] >= 10 and starts[-1]["resumed_from"]  # from its checkpoint
    others = [t for t in trials if t.user_attrs.get("worker", "").endswith(f":{other.pid}")]
    assert others and all(t.state.name == "COMPLETE" and not t.user_attrs.get("interrupted") for t in others)
    rows = _table(sweep_dir)
    assert [row["note"] for row in rows if row["trial"] == str(lost[0].number)] == ["worker lost (no heartbeat)"]


@pytest.mark.slow
def test_postgresql_storage_shared_by_two_commands_as_two_machines(tmp_path, postgres_url):  # noqa: F811
    dirs = [tmp_path / "machine-a", tmp_path / "machine-b"]
    procs = [_start(tmp_path, d, 4, "--storage", postgres_url) for d in dirs]
    results = [_finish(p) for p in procs]
    assert [r["trials"] for r, _ in results] == [4, 4]
    trials = [t for t in _trials(postgres_url) if not t.user_attrs.get("surplus")]
    assert len(trials) == 4 and all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    ran = {d: [t for t in trials if t.user_attrs["run_dir"].startswith(str(d))] for d in dirs}
    assert all(ran.values())  # each "machine" ran trials, in its own folder
    for d in dirs:
        assert len(_table(d)) == 4  # every folder's table is the whole search's
        cfg = build_config(config_file=d / "best.yaml")  # from the storage, whichever machine ran it
        assert cfg.train.total_steps == 20 and cfg.train.run_dir is None
    assert "vitflow-test" not in (dirs[0] / "sweep.json").read_text()  # the password is not written


def test_bad_storage_and_another_search_are_one_line_and_change_nothing(tmp_path, postgres_url,  # noqa: F811
                                                                        postgres_server):  # noqa: F811
    space = _space(tmp_path)
    closed = f"postgresql://vitflow:secret@127.0.0.1:{postgres_server.port + 1}/nothing"
    theirs = tmp_path / "theirs.db"  # a SQLite database of the user's: Optuna's tables must not go into it
    with sqlite3.connect(theirs) as db:
        db.execute("CREATE TABLE foo (x INTEGER)")
    before = theirs.read_bytes()
    with pytest.raises(SweepError, match=r"holds tables that are not an Optuna storage's \(foo\)"):
        run_sweep(space, 1, tmp_path / "d", overrides=SHORT, storage=f"sqlite:///{theirs}")
    assert theirs.read_bytes() == before and not (tmp_path / "d").exists()
    text = tmp_path / "notes.db"
    text.write_text("not a database\n" * 100)
    for url, says in [(closed, "cannot open it"), ("not a url", "not a database URL"), ("", "an empty URL"),
                      ("nosuchdb://host/x", "is not a database SQLAlchemy knows"),
                      (f"sqlite:///{text}", "not an Optuna storage this version can use")]:
        with pytest.raises(SweepError, match=says) as e:
            run_sweep(space, 1, tmp_path / "d", overrides=SHORT, storage=url)
        assert "\n" not in str(e.value) and "secret" not in str(e.value)
        assert not (tmp_path / "d").exists()
    assert text.read_text() == "not a database\n" * 100
    echo: list[str] = []
    r = run_sweep(space, 1, tmp_path / "a", overrides=SHORT, storage=postgres_url, echo=echo.append)
    assert r["trials"] == 1
    with pytest.raises(SweepError, match=r"study 'sweep' in the storage is another search \(different metric"):
        run_sweep(space, 1, tmp_path / "b", overrides=SHORT, storage=postgres_url, metric="val_loss")
    assert not (tmp_path / "b").exists()
    with pytest.raises(SweepError, match=r"holds another sweep \(different metric"):
        run_sweep(space, 1, tmp_path / "a", overrides=SHORT, storage=postgres_url, metric="val_loss", study="other")
    r = run_sweep(space, 1, tmp_path / "c", overrides=SHORT, storage=postgres_url, echo=echo.append)
    assert r["trials"] == 1 and echo[-1].startswith("the sweep has 1 finished trials (--trials 1): nothing to run")
