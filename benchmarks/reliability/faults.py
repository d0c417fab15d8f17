"""Fault injection: every fault a run meets on real machines, injected into real `vitflow`
processes on a busy machine, and whether anything was lost.

    python benchmarks/reliability/faults.py [--json] [--kills 30] [--seed 0] [--no-contention]

Cases: a reused run folder (another run's, and a folder of the user's), a failed start, a resume
of a folder that does not exist, SIGTERM, SIGKILL at random moments and during checkpoint writes
(resumed again and again until the run ends), a disk that fills up (a small tmpfs when this
process may mount one, else a per-process file-size limit), a truncated newest checkpoint, an
unfinished checkpoint write, a crafted CIFAR batch, a file name that is not UTF-8 through
``--json`` and ``--csv``, a tar cut at a member boundary and an unsupported ONNX opset; and two
things at once (``faults_concurrent.py``): two trains into one folder (at the same instant, 8 s
apart in both orders), a resume while the run trains, the claim of a killed run, eval / predict /
export of a run whose newest checkpoint is cut, a validation split missing classes. Everything runs
under CPU contention: a busy-loop neighbour process per core, started before the reference run and
stopped at the end (``--no-contention``: none). Each case prints what was injected, what vitflow
did and whether anything was lost: weights equal to an uninterrupted run (bit for bit, CPU, one
thread), records equal (every train / eval / epoch record and the summary, measured fields aside),
the user's files byte-identical. The choices made by timing are cached in the suite's own folder
(``VITFLOW_CHOICES_CACHE``): the reference run makes them, every other run takes them. The last
line with ``--json``: ``{"cases": N, "passed": N, "kills": K, "bit_identical_resumes": R}``, ``R``
the cases that resume from a checkpoint (SIGTERM, each SIGKILL chain with a resume, the disk full,
the truncated checkpoint, the killed run's claim) and ended bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import faults_concurrent as concurrent
import numpy as np
import torch
from PIL import Image

from vitflow import checkpoint as ckpt
from vitflow.rundir import read_metrics

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
STEPS = 40
RUN = ["train.total_steps=%d" % STEPS, "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.threads=1",
       "train.log_every=1", "model.drop_path_rate=0.1", "train.precision=fp32"]
MEASURED = {"time", "images_per_s", "data_stall", "memory_mb", "elapsed_s", "train_images_per_s", "run_dir",
            "checkpoint", "samples"}


def vitflow(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vitflow", "-q", *args], env=ENV, capture_output=True, text=True,
                          **kw)


def vitflow_bytes(*args: str) -> subprocess.CompletedProcess:
    """A vitflow command whose output is kept as bytes (so that invalid UTF-8 would show)."""
    return subprocess.run([sys.executable, "-m", "vitflow", "-q", *args], env=ENV, capture_output=True)


def unescape(name: str) -> bytes:
    """A file name of vitflow's JSON / CSV back to its bytes (docs/troubleshooting.md): ``\\xNN`` is byte NN."""
    return re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes.fromhex(m[1].decode()), name.encode("utf-8"))


def records(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(run)
            if r["kind"] in ("train", "eval", "epoch", "summary")]


def same_weights(a: Path, b: Path) -> bool:
    sa, sb = ckpt.load_checkpoint(a), ckpt.load_checkpoint(b)
    return sa["step"] == sb["step"] and all(torch.equal(v, sb["model"][k]) for k, v in sa["model"].items())


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class Suite:
    def __init__(self, tmp: Path, reference: Path):
        self.tmp, self.reference, self.rows, self.kills, self.resumes = tmp, reference, [], 0, 0
        self.resume_cases, self.env, self.run_args = 0, ENV, RUN

    def resumed(self, bit_identical: bool) -> None:
        """A case that resumed from a checkpoint: counted, and counted bit-identical when it was."""
        self.resume_cases += 1
        self.resumes += bool(bit_identical)

    def case(self, name: str, injected: str, did: str, nothing_lost: bool) -> None:
        self.rows.append({"case": name, "injected": injected, "vitflow": did, "nothing_lost": bool(nothing_lost)})
        print(f"{'ok  ' if nothing_lost else 'LOST'} {name:22s} {injected} -> {did}", flush=True)

    def finished_equal(self, run: Path) -> bool:
        """The run ended as the uninterrupted one did (weights and records); prints what differs."""
        if not same_weights(self.reference, run):
            print(f"     {run.name}: weights differ from the uninterrupted run's")
            return False
        a, b = records(self.reference), records(run)
        if a != b:
            diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"     {run.name}: records differ at {diff} ({len(a)} vs {len(b)}): "
                  f"{a[diff] if diff < len(a) else None} vs {b[diff] if diff < len(b) else None}")
            return False
        return True


def trained_steps(run: Path) -> int:
    """The last step of the run's ``train`` records (0 before any)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if r.get("kind") == "train":
            steps.append(r["step"])
    return max(steps)


def kill_chain(suite: Suite, run: Path, rng: random.Random, kills: int, during_writes: bool) -> tuple[int, int, bool]:
    """Start the run, SIGKILL it ``kills`` times, resuming after each; finish it. The moments, at a
    random step ahead (so that the chain moves on and resumes from checkpoints however slow the
    machine): the moment the next checkpoint write's temporary file appears (``during_writes``), or
    that step itself; and, not ``during_writes``, one kill in five at a random time of the start-up
    instead (0.5-6 s: imports, the claim, data and model). Returns (kills made, resumes from a
    checkpoint, finished equal to the uninterrupted run)."""
    made = resumes = 0
    cmd = [sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *RUN]
    while True:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if made < kills:
            at_start = not during_writes and rng.random() < 0.2
            deadline = time.time() + (rng.uniform(0.5, 6.0) if at_start else 600)
            target = rng.randint(min(trained_steps(run) + 1, STEPS - 1), STEPS - 1)
            while proc.poll() is None and time.time() < deadline:
                if during_writes and list((run / "checkpoints").glob(".step-*.tmp")) and trained_steps(run) >= target:
                    break
                if not during_writes and not at_start and trained_steps(run) >= target:
                    break
                time.sleep(0.0005 if during_writes else 0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                made += 1
        proc.wait()
        for c in ckpt.list_checkpoints(run):  # every checkpoint on disk is complete
            ckpt.load_checkpoint(c)
        if proc.returncode == 0:
            return made, resumes, suite.finished_equal(run)
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"run failed: {proc.stderr.read().decode()[-2000:]}")
        resumes += ckpt.latest_checkpoint(run) is not None
        if run.exists():  # killed before the folder was made: the same command again, as a user would
            cmd = [sys.executable, "-m", "vitflow", "-q", "resume", str(run)]


def folders(suite: Suite) -> None:
    other = suite.tmp / "other-run"
    shutil.copytree(suite.reference, other)
    before = snapshot(other)
    r = vitflow("train", f"train.run_dir={other}", "train.total_steps=2")
    suite.case("reused run folder", "a new run into another run's folder", r.stderr.strip().splitlines()[-1][:90],
               r.returncode == 2 and snapshot(other) == before)
    mine = suite.tmp / "user-folder"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own\n")
    (mine / "metrics.jsonl").write_text('{"mine": 1}\n')
    before = snapshot(mine)
    r = vitflow("train", f"train.run_dir={mine}", "train.total_steps=2")
    suite.case("user's folder", "a run into a folder of the user's", r.stderr.strip().splitlines()[-1][:90],
               r.returncode == 2 and snapshot(mine) == before)
    gone = suite.tmp / "never"
    r = vitflow("train", "--preset", "cifar10-vit-tiny", "data.path=/nonexistent", f"train.run_dir={gone}")
    suite.case("failed start", "a run whose data path is wrong", f"exit {r.returncode}, folder left: {gone.exists()}",
               r.returncode == 2 and not gone.exists())
    r = vitflow("resume", str(suite.tmp / "typo"))
    suite.case("resume of a typo", "vitflow resume of a folder that does not exist",
               r.stderr.strip().splitlines()[-1][:90], r.returncode == 2 and not (suite.tmp / "typo").exists())


def sigterm(suite: Suite) -> None:
    run = suite.tmp / "sigterm"
    proc = subprocess.Popen([sys.executable, "-m", "vitflow", "train", f"train.run_dir={run}", *RUN], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while proc.poll() is None and not (run / "checkpoints").is_dir():
        time.sleep(0.01)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate()
    hint = f"vitflow resume {run}" in out
    r = vitflow("resume", str(run))
    equal = proc.returncode == 143 and hint and r.returncode == 0 and suite.finished_equal(run)
    suite.resumed(equal)
    suite.case("SIGTERM", "SIGTERM mid-run, then the printed command",
               f"exit {proc.returncode}, hint {'printed' if hint else 'MISSING'}, resumed",
               equal)


def disk_full(suite: Suite) -> None:
    """A run whose checkpoints outgrow the disk: one line, the previous checkpoint intact; then,
    with space, the resume ends as the uninterrupted run."""
    size = ckpt.checkpoint_path(suite.reference, STEPS).stat().st_size
    mount = suite.tmp / "small-disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 3.5)}", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    run = mount / "run"
    limit = None if mounted else size // 2  # else: a file-size limit (EFBIG) stands in for the full disk

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *RUN[:2], "train.keep_checkpoints=9",
           *RUN[3:]]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, preexec_fn=small_files if limit else None)
    line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    kept = ckpt.list_checkpoints(run)
    intact = all(ckpt.load_checkpoint(c) for c in kept) and not list((run / "checkpoints").glob(".*.tmp"))
    if mounted:
        subprocess.run(["mount", "-o", f"remount,size={int(size * 40)}", str(mount)], check=True)
    r2 = vitflow("resume", str(run), "train.keep_checkpoints=3")
    equal = r2.returncode == 0 and same_weights(suite.reference, run) and records(suite.reference) == records(run)
    suite.resumed(equal)
    if mounted:
        subprocess.run(["umount", str(mount)])
    suite.case("disk full", f"{'a tmpfs of ' + str(int(size * 3.5 / 1024)) + ' KiB' if mounted else 'a file-size limit'}",
               f"exit {r.returncode}: {line[:70]}; {len(kept)} checkpoint(s) intact; resumed with space",
               r.returncode == 1 and line.startswith("error:") and (kept or limit) and intact and equal)


def truncated_newest(suite: Suite) -> None:
    """The run's last checkpoint never written, the one before it cut in half (a killed copy), an
    unfinished write left behind: the resume warns, takes the newest readable one, cleans up and
    ends as the uninterrupted run."""
    run = suite.tmp / "truncated"
    shutil.copytree(suite.reference, run)
    ckpt.checkpoint_path(run, STEPS).unlink()
    cut = ckpt.checkpoint_path(run, STEPS - 2)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    orphan = run / "checkpoints" / f".step-{STEPS:08d}.pt.tmp"
    orphan.write_bytes(b"half")
    r = vitflow("resume", str(run))
    warned = "skipping unreadable checkpoint" in r.stderr
    equal = r.returncode == 0 and warned and not orphan.exists() and suite.finished_equal(run)
    suite.resumed(equal)
    suite.case("truncated checkpoint", "the newest checkpoint cut in half, an unfinished write left",
               f"{'warned, took the one before' if warned else 'no warning'}; orphan removed: {not orphan.exists()}",
               equal)


def inputs(suite: Suite) -> None:
    cifar = suite.tmp / "cifar"
    cifar.mkdir()
    marker = suite.tmp / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (cifar / "batches.meta").write_bytes(pickle.dumps({b"label_names": [b"a", b"b"]}, protocol=2))
    (cifar / "data_batch_1").write_bytes(pickle.dumps({b"data": Payload()}))
    r = vitflow("prepare", str(cifar), str(suite.tmp / "cifar-packed"))
    suite.case("crafted CIFAR batch", "a batch whose pickle runs code", r.stderr.strip().splitlines()[-1][:90],
               r.returncode == 2 and not marker.exists())
    pets = suite.tmp / "pets"
    for c in ("ants", "bees"):
        (pets / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(pets / c / f"{i}.png")
    with open(os.fsencode(pets / "ants") + b"/caf\xe9.png", "wb") as f:
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(f, "PNG")
    r = vitflow("train", "--preset", "cifar10-vit-tiny", f"data.path={pets}", "model.img_size=16",
                "data.train_split=train[:75%]", "data.test_split=train[75%:]", "train.batch_size=4",
                "train.total_steps=2", f"train.run_dir={suite.tmp / 'pets-run'}")
    odd = os.fsencode(pets / "ants") + b"/caf\xe9.png"
    p = vitflow_bytes("predict", str(suite.tmp / "pets-run"), str(pets), "--json")
    back = {bytes.fromhex(row["path_bytes"]) if "path_bytes" in row else unescape(row["path"])
            for row in map(json.loads, p.stdout.decode("utf-8", "strict").splitlines())}  # strict: valid UTF-8
    c = vitflow_bytes("predict", str(suite.tmp / "pets-run"), str(pets), "--csv")
    table = list(csv.reader(io.StringIO(c.stdout.decode("utf-8", "strict"))))
    in_csv = odd in {unescape(row[0]) for row in table[1:]}
    suite.case("non-UTF-8 file name", "caf\\xe9.png among the images, --json and --csv",
               f"train exit {r.returncode}, predict exits {p.returncode} {c.returncode}, valid UTF-8, bytes back: "
               f"JSON {odd in back}, CSV {in_csv}", r.returncode == 0 and p.returncode == 0 and c.returncode == 0
               and odd in back and in_csv)
    tar = suite.tmp / "pets.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(pets, "pets")
    with tarfile.open(tar) as tf:
        cut_at = tf.getmembers()[-2].offset
    cut = suite.tmp / "cut.tar"
    cut.write_bytes(tar.read_bytes()[:cut_at])
    r = vitflow("bench", "data", "--data", str(cut), "--image-size", "16", "--batch-size", "4", "--repeats", "1")
    suite.case("tar cut short", "a tar cut at a member boundary", "warned" if "cut short" in r.stderr else "silent",
               "cut short" in r.stderr)
    r = vitflow("export", str(suite.reference), "-o", str(suite.tmp / "m.onnx"), "--opset", "17")
    suite.case("unsupported opset", "export --opset 17", r.stderr.strip().splitlines()[-1][:90],
               r.returncode == 2 and not (suite.tmp / "m.onnx").exists())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=30, help="SIGKILLs in all (at least 30 for the record)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-contention", action="store_true", help="no busy-loop neighbours")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vitflow-faults-") as tmp, \
            concurrent.Contention(not args.no_contention) as load:
        tmp = Path(tmp)
        ENV["VITFLOW_CHOICES_CACHE"] = str(tmp / "choices.json")  # made by the reference run, taken by the others
        print(f"CPU contention: {load.n} busy-loop neighbour(s) on {os.cpu_count()} core(s)", flush=True)
        reference = tmp / "reference"
        r = vitflow("train", f"train.run_dir={reference}", *RUN)
        if r.returncode:
            raise SystemExit(r.stderr)
        suite = Suite(tmp, reference)
        folders(suite)
        for gap, first in ((0, 1), (8, 1), (8, 2)):
            concurrent.two_trains(suite, gap, first)
        concurrent.resume_while_training(suite)
        sigterm(suite)
        chains, left = 0, args.kills - 1  # (the killed run's claim is one kill)
        while left > 0:  # chains of kills, alternately at random moments and during checkpoint writes
            n = min(left, 5)
            made, resumes, equal = kill_chain(suite, tmp / f"killed-{chains}", rng, n, during_writes=chains % 2 == 1)
            suite.kills += made
            if resumes:
                suite.resumed(equal)
            suite.case(f"SIGKILL chain {chains}", f"{made} kills {'in checkpoint writes' if chains % 2 else 'at random'}",
                       f"resumed {resumes} time(s) from a checkpoint, finished", equal)
            left, chains = left - max(made, 1), chains + 1
        concurrent.killed_holder(suite)
        disk_full(suite)
        truncated_newest(suite)
        concurrent.cut_newest_readers(suite)
        concurrent.missing_val_class(suite)
        inputs(suite)
    passed = sum(r["nothing_lost"] for r in suite.rows)
    print(f"{passed} of {len(suite.rows)} cases lost nothing; {suite.kills} SIGKILLs; {suite.resumes} of the "
          f"{suite.resume_cases} cases that resume ended bit-identical to the uninterrupted run "
          f"({time.perf_counter() - t0:.0f} s, {load.n} busy-loop neighbours)")
    if args.json:
        print(json.dumps({"cases": len(suite.rows), "passed": passed, "kills": suite.kills,
                          "bit_identical_resumes": suite.resumes}))


if __name__ == "__main__":
    main()
