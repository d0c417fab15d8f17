"""One writer per run folder: the claim (``vitflow.training.run.folder.claim_run_dir``) refuses a second
holder with one line naming the first, takes over a claim left by a killed process, falls back to
an ``O_EXCL`` marker where ``flock`` does not work, and guards ``train``, ``resume`` and ``sweep``
trials alike; two real ``vitflow train`` started at the same instant: one runs, one refuses."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import ENV, snapshot
from vitflow.cli import main
from vitflow.training.run import folder as rd

HOLD = ("import sys, time; from vitflow.training.run.folder import claim_run_dir; c = claim_run_dir(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


def _no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(rd.fcntl, "flock", flock)


@pytest.mark.parametrize("mode", ["flock", "marker"])
def test_a_second_claim_refuses_naming_the_holder_and_a_released_one_leaves_nothing(tmp_path, monkeypatch, mode):
    if mode == "marker":
        _no_flock(monkeypatch)
    run = tmp_path / "new" / "run"
    first = rd.claim_run_dir(run)
    assert first.mode == mode and (tmp_path / "new" / ".run.lock").is_file() and not run.exists()
    with pytest.raises(rd.RunDirBusy) as e:
        rd.claim_run_dir(tmp_path / "new" / ".." / "new" / "run")  # another spelling of the same folder
    msg = str(e.value)
    assert f"{run} is in use by another vitflow run (pid {os.getpid()} on host {socket.gethostname()}, started " \
           in msg and "choose another train.run_dir" in msg and "\n" not in msg
    first.release()
    first.release()  # twice: harmless
    assert not (tmp_path / "new").exists()  # the folders made for the claim went with it
    second = rd.claim_run_dir(run)
    assert second.mode == mode
    second.release()


def test_a_claim_left_by_a_killed_process_is_taken_over_and_said_so(tmp_path, caplog):
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(rd.RunDirBusy, match=f"pid {child.pid} on host"):
        rd.claim_run_dir(run)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == child.pid  # left behind
    with caplog.at_level(logging.WARNING):
        claim = rd.claim_run_dir(run)
    assert f"took over the claim left by pid {child.pid} on host {socket.gethostname()}" in caplog.text
    assert "which is no longer running" in caplog.text
    assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
    claim.release()


def test_the_marker_fallback_takes_over_a_dead_holder_and_refuses_another_hosts(tmp_path, monkeypatch, caplog):
    _no_flock(monkeypatch)
    lock = tmp_path / ".run.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "started": "then"}))
    with caplog.at_level(logging.WARNING):
        claim = rd.claim_run_dir(tmp_path / "run")
    assert claim.mode == "marker" and f"took over the claim left by pid {int(dead.stdout)}" in caplog.text
    claim.release()
    assert not lock.exists()
    lock.write_text(json.dumps({"pid": 1, "host": "node-7", "started": "2030-01-01 10:00:00"}))
    with pytest.raises(rd.RunDirBusy) as e:
        rd.claim_run_dir(tmp_path / "run")
    assert "(pid 1 on host node-7, started 2030-01-01 10:00:00); if that process is gone (a lost node), " \
           f"delete {lock} and start again" in str(e.value)
    assert lock.is_file()


def test_train_resume_and_a_sweep_trial_refuse_a_claimed_folder_and_touch_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    (tmp_path / ".run.partial-node-7-4242" / "checkpoints").mkdir(parents=True)  # a killed start's staging folder
    assert main(["train", "-q", "train.total_steps=2", "train.precision=fp32", f"train.run_dir={run}"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # staging renamed, the dead one's removed, no lock
    before = snapshot(run)
    claim = rd.claim_run_dir(run)
    try:
        assert main(["resume", str(run), "train.total_steps=3"]) == 2
        assert f"{run} is in use by another vitflow run (pid {os.getpid()}" in capsys.readouterr().err
        fresh = tmp_path / "fresh"
        other = rd.claim_run_dir(fresh)
        assert main(["train", "-q", "train.total_steps=2", "train.precision=fp32", f"train.run_dir={fresh}"]) == 2
        assert "is in use by another vitflow run" in capsys.readouterr().err and not fresh.exists()
        other.release()
        sweep = tmp_path / "sweep"
        space = tmp_path / "space.yaml"
        space.write_text("optim.lr: {type: float, low: 0.001, high: 0.002, log: true}\n")
        args = ["sweep", "--space", str(space), "--dir", str(sweep), "--metric", "test_top1", "train.total_steps=2",
            "train.precision=fp32"]
        assert main([*args, "--trials", "1"]) == 0
        trial = rd.claim_run_dir(sweep / "trial-0001")  # the next trial's folder, held by "another process"
        assert main([*args, "--trials", "2"]) == 0
        rows = (sweep / "sweep.csv").read_text().splitlines()
        assert "fail" in rows[2].lower() and "RunDirBusy" in rows[2] and not (sweep / "trial-0001").exists()
        trial.release()
    finally:
        claim.release()
    assert snapshot(run) == before


@pytest.mark.parametrize("mode", ["flock", "marker"])
def test_threads_racing_for_a_folder_one_wins_each_time(tmp_path, monkeypatch, mode):
    """Eight threads claim one folder at the same instant (a barrier), twenty times: one wins."""
    if mode == "marker":
        monkeypatch.setenv(rd.LOCK_ENV, "marker")
    for r in range(20):
        barrier, won, refused = threading.Barrier(8), [], []

        def racer() -> None:
            barrier.wait()
            try:
                won.append(rd.claim_run_dir(tmp_path / f"run-{r}"))
            except rd.RunDirBusy as e:
                refused.append(str(e))

        threads = [threading.Thread(target=racer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(refused) == 7 and won[0].mode == mode
        assert all(f"in use by another vitflow run (pid {os.getpid()} on host" in e for e in refused)
        won[0].release()
    assert list(tmp_path.iterdir()) == []


RACER = """
import json, sys, time
from vitflow.training.run.folder import RunDirBusy, claim_run_dir
print("ready", flush=True)
start, rounds = float(sys.stdin.readline()), int(sys.argv[2])
for r in range(rounds):
    time.sleep(max(0.0, start + 1.5 * r - time.time()))  # every racer at the same instant
    try:
        claim = claim_run_dir(f"{sys.argv[1]}/run-{r}")
    except RunDirBusy as e:
        print(json.dumps({"round": r, "refused": str(e)}), flush=True)
        continue
    print(json.dumps({"round": r, "won": True}), flush=True)
    time.sleep(1.0)  # held while the others try
    claim.release()
"""


@pytest.mark.slow
def test_processes_racing_for_a_folder_one_wins_each_time(tmp_path):
    """Two processes claim one folder at the same instant, four times: exactly one wins each
    round and the others name it. (Two real ``vitflow train``, 100 times: ``benchmarks/reliability/run_dir_race.py``.)"""
    rounds = 4
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(rounds)], env=ENV, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    assert all(p.stdout.readline().strip() == "ready" for p in procs)  # imports done
    start = time.time() + 1.0
    for p in procs:
        p.stdin.write(f"{start}\n")
        p.stdin.flush()
    results = [json.loads(line) for p in procs for line in p.communicate(timeout=120)[0].splitlines()]
    assert all(p.returncode == 0 for p in procs)
    for r in range(rounds):
        this = [x for x in results if x["round"] == r]
        assert len(this) == 2 and sum("won" in x for x in this) == 1, this
        assert all("is in use by another vitflow run (pid " in x["refused"] for x in this if "refused" in x)
    assert list(tmp_path.iterdir()) == []  # no lock, no folder left
