"""``vitflow sweep`` on the embedded digits: six trials with median pruning, the table and the best
config; a sweep stopped by SIGINT and continued by the same command (the stopped trial from its
checkpoint). Several workers: ``test_sweep_workers.py``."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ENV, sigint_as_in_a_terminal
from vitflow.config import build_config
from vitflow.rundir import read_metrics
from vitflow.training.sweep import SweepError, read_space

pytest.importorskip("optuna")
SPACE = {"optim.lr": {"type": "float", "low": 1e-5, "high": 3e-2, "log": True},
         "optim.weight_decay": {"type": "categorical", "choices": [0.0, 0.05]}}
# each trial: 30 steps, evaluated on a validation split every 5 (the pruner's intermediate values)
TRIAL = ["train.total_steps=30", "train.eval_every=5", "train.log_every=10", "optim.warmup_steps=0",
         "data.train_split=train[:80%]", "data.val_split=train[80%:90%]", "data.test_split=train[90%:]"]


def _sweep(tmp_path: Path, *extra: str, wait: bool = True):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    cmd = [sys.executable, "-m", "vitflow", "-q", "sweep", "--space", str(space), "--trials", "6", "--dir",
           str(tmp_path / "sweep"), "--prune-after", "2", "--json", *TRIAL, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=sigint_as_in_a_terminal)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _table(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_sweep_prunes_writes_the_table_and_best_config_and_continues_after_sigint(tmp_path):
    proc = _sweep(tmp_path, wait=False)
    second = tmp_path / "sweep" / "trial-0001"
    deadline = time.monotonic() + 300
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # while the second trial trains (or, at worst, starts)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "continue the sweep with the same command" in err or "interrupted" in err
    before = _table(tmp_path / "sweep" / "sweep.csv")
    assert before[0]["state"] == "complete"

    r = _sweep(tmp_path)  # the same command again: on to 6 trials
    rows = _table(tmp_path / "sweep" / "sweep.csv")
    interrupted = [row for row in rows if row["note"] == "interrupted" or row["note"].startswith("SIGINT")]
    assert len(interrupted) == 1 and interrupted[0]["state"] == "fail"
    counted = [row for row in rows if row not in interrupted]
    assert len(counted) == 6 and r["trials"] == 6 and r["complete"] + r["pruned"] == 6 and r["pruned"] >= 1
    assert rows[0] == before[0]  # the finished trial is kept as it was
    rerun = rows[int(interrupted[0]["trial"]) + 1]  # the interrupted trial's values run again, next
    assert (rerun["optim.lr"], rerun["optim.weight_decay"]) == (interrupted[0]["optim.lr"],
                                                                interrupted[0]["optim.weight_decay"])
    assert rerun["run_dir"] == interrupted[0]["run_dir"]  # in its run folder, from the checkpoint of the signal
    note = interrupted[0]["note"]  # "SIGINT at step N"; a signal before the first step leaves no checkpoint
    stopped_at = int(note.rsplit(" ", 1)[1]) if note.startswith("SIGINT at step") else 0
    starts = [e for e in read_metrics(rerun["run_dir"]) if e["kind"] == "start"]
    assert starts[-1]["step"] == stopped_at and bool(starts[-1]["resumed_from"]) == (stopped_at > 0)
    assert len(starts) == (2 if stopped_at else 1)  # (a run that never wrote a checkpoint starts over, emptied)
    assert {row["state"] for row in counted} == {"complete", "pruned"}

    for row in counted:  # each trial is a normal run directory; its value is its own record's
        records = read_metrics(row["run_dir"])
        evals = [e for e in records if e["kind"] == "eval" and e["split"] == "val"]
        if row["state"] == "complete":
            summary = next(e for e in records if e["kind"] == "summary")
            assert float(row["value"]) == pytest.approx(summary["val_top1"], abs=1e-6)  # records: 6 decimals
            assert [e["step"] for e in evals] == [5, 10, 15, 20, 25, 30]
        else:
            pruned = next(e for e in records if e["kind"] == "pruned")
            assert pruned["step"] == evals[-1]["step"] < 30
            assert pruned["value"] == pytest.approx(evals[-1]["top1"], abs=1e-6)
    best = max((row for row in counted if row["state"] == "complete"), key=lambda row: float(row["value"]))
    assert r["best"]["trial"] == int(best["trial"]) and r["best"]["run_dir"] == best["run_dir"]

    cfg = build_config(config_file=tmp_path / "sweep" / "best.yaml")  # loadable as it is
    assert cfg.optim.lr == pytest.approx(float(best["optim.lr"]))
    assert cfg.optim.weight_decay == float(best["optim.weight_decay"])
    assert cfg.train.run_dir is None and cfg.train.total_steps == 30 and cfg.data.val_split == "train[80%:90%]"


def test_space_file_and_folder_errors_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim.lrr: {type: float, low: 0.1, high: 1}\n")
    with pytest.raises(SweepError, match=r"optim.lrr: not a config key"):
        read_space(bad)
    bad.write_text("optim.lr: {type: float, low: 0, high: 1, log: true}\n")
    with pytest.raises(SweepError, match=r"optim.lr: needs numbers low < high \(and low > 0 with log: true\)"):
        read_space(bad)
    bad.write_text("optim.name: {type: categorical, choices: []}\n")
    with pytest.raises(SweepError, match="non-empty list of choices"):
        read_space(bad)
    for text, says in [("optim.lr: {type: float, low: 0.001, high: 0.01, color: red}", "color is not a field of type float"),
                       ("optim.warmup_steps: {type: int, low: 0, high: 1.5}", "needs whole numbers low < high"),
                       ("optim.lr: {type: float, low: 0.001, high: 0.01, step: 0.003, log: true}",
                        "step and log: true do not go together"),
                       ("optim.lr: {type: float, low: [1", r"line \d+, column \d+: not YAML")]:
        bad.write_text(text + "\n")
        with pytest.raises(SweepError, match=f"--space {bad}.*{says}") as e:
            read_space(bad)
        assert "\n" not in str(e.value)
    from vitflow.training.sweep import run_sweep

    bad.write_text(yaml.safe_dump(SPACE))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SweepError, match="is not empty and holds no sweep"):
        run_sweep(bad, 1, tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_lone_worker_draws_as_it_would_without_a_stop():
    """The sampler's seed of a trial counts the draws before it, not the trials: a stopped trial's
    values running again (``retry_of``) and surplus trials do not shift the later proposals."""
    optuna = pytest.importorskip("optuna")
    from vitflow.training.sweep.storage import draws_before

    study = optuna.create_study()
    first = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})  # trial 0: drawn, then stopped
    study.tell(first, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial(first.params, user_attrs={"retry_of": 0})
    study.tell(study.ask(), 1.0)  # trial 1 runs trial 0's values again
    surplus = study.ask()  # trial 2, dropped at the end of another worker's sweep
    surplus.set_user_attr("surplus", True)
    study.tell(surplus, state=optuna.trial.TrialState.FAIL)
    assert [draws_before(study, n) for n in (0, 1, 2, 3)] == [0, 1, 1, 1]  # trial 3 draws as trial 1 would have