"""The cases of ``faults.py`` where two things happen at once or a reader meets a damaged run (issue
40): two trains into one folder (at the same instant, and 8 s apart in both orders), a resume
while the run trains, a claim left by a killed process, eval / predict / export of a run whose
newest checkpoint is cut, a validation split missing a class; and the busy-loop neighbours that
load every core while the suite runs (:class:`Contention`)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vitflow import checkpoint as ckpt
from vitflow.rundir import read_metrics

SHORT = ["train.total_steps=4", "train.threads=1", "train.live_report=false"]


def _spin(parent: int) -> None:
    while os.getppid() == parent:  # (ends with the suite, however the suite ends)
        for _ in range(1_000_000):
            pass


class Contention:
    """One busy-loop process per core for the life of the ``with`` block (stopped at its end)."""

    def __init__(self, on: bool = True):
        self.n, self.procs = (os.cpu_count() or 1) if on else 0, []

    def __enter__(self) -> Contention:
        ctx = multiprocessing.get_context("fork")
        self.procs = [ctx.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()


def _train(suite, run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *extra],
                            env=suite.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_runs_files(run: Path, seed: int) -> bool:
    """The folder holds exactly one run's files: the winner's (``train.seed``) config, one start
    and one summary record, its checkpoints only, no lock or staging folder beside it."""
    kinds = [r["kind"] for r in read_metrics(run)]
    states = [ckpt.load_checkpoint(p) for p in ckpt.list_checkpoints(run)]
    return (f"seed: {seed}" in (run / "config.yaml").read_text() and kinds.count("start") == 1
            and kinds.count("summary") == 1 and bool(states) and all(s["config"]["train"]["seed"] == seed
                                                                    for s in states)
            and sorted(p.name for p in run.parent.iterdir()) == [run.name])


def two_trains(suite, gap: float, first_seed: int) -> None:
    """Two ``vitflow train`` into one new folder, ``gap`` seconds apart (seeds 1 and 2, ``first_seed``
    started first): one runs, one refuses naming it, the folder holds the winner's run only. With a
    gap, the first is held (SIGSTOP) once it has claimed the folder until the second has ended, so
    that the second meets a running first run however fast the machine (a 4-step run can end
    within 8 s, and the second then meets a finished run: another case)."""
    run = suite.tmp / f"two-{gap:g}s-{first_seed}" / "run"
    run.parent.mkdir()
    seeds = [first_seed, 3 - first_seed]
    started = time.monotonic()
    procs = [_train(suite, run, *SHORT, f"train.seed={seeds[0]}")]
    if gap:
        lock = run.parent / f".{run.name}.lock"
        while procs[0].poll() is None and not (lock.exists() and lock.stat().st_size):
            time.sleep(0.02)
        procs[0].send_signal(signal.SIGSTOP)
        time.sleep(max(0.0, started + gap - time.monotonic()))
    procs.append(_train(suite, run, *SHORT, f"train.seed={seeds[1]}"))
    second = procs[1].communicate() if gap else None
    procs[0].send_signal(signal.SIGCONT)
    results = [procs[0].communicate(), second if gap else procs[1].communicate()]
    outs = [(p.pid, seed, *out, p.returncode) for p, seed, out in zip(procs, seeds, results)]
    won = [(pid, seed) for pid, seed, _, _, rc in outs if rc == 0]
    refusal = next((err.strip().splitlines()[-1] for *_, err, rc in outs if rc == 2 and err.strip()), "")
    ok = (len(won) == 1 and f"is in use by another vitflow run (pid {won[0][0]} on host" in refusal
          and _one_runs_files(run, won[0][1]))
    suite.case(f"two trains, {gap:g} s apart" + (f" (seed {first_seed} first)" if gap else ""),
               "two vitflow train into one new folder", f"exits {sorted(o[-1] for o in outs)}: {refusal[7:80]}", ok)


def resume_while_training(suite) -> None:
    """``vitflow resume`` of a folder whose run is training (held mid-run with SIGSTOP, so that the
    resume meets it however slow the machine): refused naming it; the run, continued, ends as the
    uninterrupted one."""
    run = suite.tmp / "busy"
    proc = subprocess.Popen([sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *suite.run_args],
                            env=suite.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not (run / "checkpoints").is_dir():
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)
    r = subprocess.run([sys.executable, "-m", "vitflow", "-q", "resume", str(run)], env=suite.env,
                       capture_output=True, text=True)
    line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    proc.send_signal(signal.SIGCONT)
    proc.communicate()
    ok = (r.returncode == 2 and f"is in use by another vitflow run (pid {proc.pid} on host" in line
          and proc.returncode == 0 and suite.finished_equal(run))
    suite.case("resume while it trains", "vitflow resume of a folder whose run is training", line[7:87], ok)


def killed_holder(suite) -> None:
    """A run SIGKILLed after its first checkpoint leaves its claim behind: the resume takes it over
    (said so) and ends as the uninterrupted run."""
    run = suite.tmp / "killed-holder"
    proc = subprocess.Popen([sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *suite.run_args],
                            env=suite.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not ckpt.list_checkpoints(run):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    suite.kills += 1
    left = run.with_name(f".{run.name}.lock")
    held_by = json.loads(left.read_text())["pid"] if left.is_file() else None
    r = subprocess.run([sys.executable, "-m", "vitflow", "-q", "resume", str(run)], env=suite.env,
                       capture_output=True, text=True)
    said = f"took over the claim left by pid {proc.pid} on host" in r.stderr and "no longer running" in r.stderr
    equal = held_by == proc.pid and said and r.returncode == 0 and suite.finished_equal(run)
    suite.resumed(equal)
    suite.case("claim of a killed run", "SIGKILL after the first checkpoint, its lock file left",
               f"lock of pid {held_by} {'taken over, said so' if said else 'NOT taken over'}; resumed", equal)


def cut_newest_readers(suite) -> None:
    """eval / predict / export of a run whose newest checkpoint is cut in half: each warns and reads
    the one before; the cut file named explicitly is an error naming the readable ones."""
    run = suite.tmp / "cut-readers"
    shutil.copytree(suite.reference, run)
    newest = ckpt.latest_checkpoint(run)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    before = ckpt.list_checkpoints(run)[-2].name
    samples = run / "samples"
    for name, args in (("eval", ["eval", str(run), "--json"]), ("predict", ["predict", str(run), str(samples), "--json"]),
                       ("export", ["export", str(run), "--format", "torchscript", "-o", str(suite.tmp / "m.ts")])):
        r = subprocess.run([sys.executable, "-m", "vitflow", "-q", *args], env=suite.env, capture_output=True, text=True)
        warned = f"skipping unreadable checkpoint {newest}" in r.stderr
        took = before in r.stdout if name == "eval" else True
        extra = ""
        if name == "eval":
            e = subprocess.run([sys.executable, "-m", "vitflow", "-q", "eval", str(newest)], env=suite.env,
                               capture_output=True, text=True)
            extra_ok = e.returncode == 2 and f"readable checkpoints of this run: {before}" in e.stderr
            extra, took = f"; the cut file named: exit {e.returncode}", took and extra_ok
        suite.case(f"{name} of a cut run", "its newest checkpoint cut in half",
                   f"exit {r.returncode}, {'warned, read ' + before if warned else 'NO warning'}{extra}",
                   r.returncode == 0 and warned and took)


def missing_val_class(suite) -> None:
    """A validation split without one class (its folder absent) and another (its folder empty): the
    run warns naming the split and classes; macro averages count the classes present only."""
    data = suite.tmp / "three"
    for split, classes in (("train", "abc"), ("val", "a")):
        for c in classes:
            (data / split / c).mkdir(parents=True)
            for i in range(8 if split == "train" else 4):
                Image.fromarray(np.full((8, 8, 3), 60 * "abc".index(c) + i, np.uint8)).save(data / split / c / f"{i}.png")
    (data / "val" / "b").mkdir()  # empty
    run = suite.tmp / "three-run"
    r = subprocess.run([sys.executable, "-m", "vitflow", "-q", "train", "--preset", "cifar10-vit-tiny",
                        f"data.path={data}", "data.test_split=none", "model.img_size=8", "train.batch_size=8", "train.total_steps=2",
                        "train.live_report=false", f"train.run_dir={run}"], env=suite.env, capture_output=True,
                       text=True)
    warned = "split 'val' of" in r.stderr and "has no images of 2 of the 3 classes (b, c)" in r.stderr
    ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else {}
    counted = ev.get("absent") == [1, 2] and abs(ev.get("macro_recall", -1) - ev.get("balanced_accuracy", -2)) < 1e-12
    suite.case("val split missing classes", "val/ without c, val/b empty",
               f"exit {r.returncode}, {'warned' if warned else 'NO warning'}, absent {ev.get('absent')}",
               r.returncode == 0 and warned and counted)
