"""Fault injection: every fault a run meets on real machines, injected into real `vitflow`
processes, and whether anything was lost.

    python benchmarks/faults.py [--json] [--kills 30] [--seed 0]

Cases: a reused run folder (another run's, and a folder of the user's), a failed start, a resume
of a folder that does not exist, SIGTERM, SIGKILL at random moments and during checkpoint writes
(resumed again and again until the run ends), a disk that fills up (a small tmpfs when this
process may mount one, else a per-process file-size limit), a truncated newest checkpoint, an
unfinished checkpoint write, a crafted CIFAR batch, a file name that is not UTF-8, a tar cut at a
member boundary and an unsupported ONNX opset. Each prints what was injected, what vitflow did and
whether anything was lost: weights equal to an uninterrupted run (bit for bit, CPU, one thread),
records equal (every train / eval / epoch record and the summary, measured fields aside), the
user's files byte-identical. The last line with ``--json``:
``{"cases": N, "passed": N, "kills": K, "bit_identical_resumes": R}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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


def kill_chain(suite: Suite, run: Path, rng: random.Random, kills: int, during_writes: bool) -> tuple[int, int, bool]:
    """Start the run, SIGKILL it ``kills`` times (at a random moment, or the moment a checkpoint
    write's temporary file appears), resuming after each; finish it. Returns (kills made, resumes
    from a checkpoint, finished equal to the uninterrupted run)."""
    made = resumes = 0
    cmd = [sys.executable, "-m", "vitflow", "-q", "train", f"train.run_dir={run}", *RUN]
    while True:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if made < kills:
            deadline = time.time() + (rng.uniform(4.0, 12.0) if not during_writes else 60)
            while proc.poll() is None and time.time() < deadline:
                if during_writes and list((run / "checkpoints").glob(".step-*.tmp")):
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
    suite.resumes += equal
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
    suite.resumes += equal
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
    suite.resumes += equal
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
    p = vitflow("predict", str(suite.tmp / "pets-run"), str(pets), "--json")
    back = {os.fsencode(json.loads(line)["path"]) for line in p.stdout.splitlines()}
    suite.case("non-UTF-8 file name", "caf\\xe9.png among the images", f"train exit {r.returncode}, predict exit "
               f"{p.returncode}, name round-trips: {os.fsencode(pets / 'ants') + b'/caf' + bytes([0xE9]) + b'.png' in back}",
               r.returncode == 0 and p.returncode == 0 and any(b.endswith(b"caf\xe9.png") for b in back))
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="vitflow-faults-") as tmp:
        tmp = Path(tmp)
        reference = tmp / "reference"
        r = vitflow("train", f"train.run_dir={reference}", *RUN)
        if r.returncode:
            raise SystemExit(r.stderr)
        suite = Suite(tmp, reference)
        folders(suite)
        sigterm(suite)
        chains, left = 0, args.kills
        while left > 0:  # chains of kills, alternately at random moments and during checkpoint writes
            n = min(left, 5)
            made, resumes, equal = kill_chain(suite, tmp / f"killed-{chains}", rng, n, during_writes=chains % 2 == 1)
            suite.kills += made
            suite.resumes += resumes if equal else 0
            suite.case(f"SIGKILL chain {chains}", f"{made} kills {'in checkpoint writes' if chains % 2 else 'at random'}",
                       "resumed after each, finished", equal)
            left, chains = left - max(made, 1), chains + 1
        disk_full(suite)
        truncated_newest(suite)
        inputs(suite)
    passed = sum(r["nothing_lost"] for r in suite.rows)
    print(f"{passed} of {len(suite.rows)} cases lost nothing; {suite.kills} SIGKILLs; {suite.resumes} resumes "
          "ended bit-identical to the uninterrupted run")
    if args.json:
        print(json.dumps({"cases": len(suite.rows), "passed": passed, "kills": suite.kills,
                          "bit_identical_resumes": suite.resumes}))


if __name__ == "__main__":
    main()
