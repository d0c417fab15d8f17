"""Resume: refused past the end, atomic checkpoints, bit-identical resume after SIGKILL, changed classes and config."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import comparable_records, digits_config, kill_at_first_checkpoint, make_folder, snapshot
from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.config import build_config
from vitflow.models.kernels import onednn
from vitflow.training import Trainer


def _train_cmd(run_dir, data, steps, *extra):
    return [sys.executable, "-m", "vitflow", "train", f"data.path={data}", "data.source=folder",
            "data.train_split=train[:75%]", "data.test_split=train[75%:]", "data.num_workers=2", "data.hflip=true",
            "model.img_size=8", "model.drop_path_rate=0.1", "model.drop_rate=0.1", "train.batch_size=8",
            f"train.total_steps={steps}", f"train.run_dir={run_dir}", "train.keep_checkpoints=100",
            "train.precision=fp32", "train.threads=1", "train.live_report=false", *extra]


def test_resume_past_total_steps_is_refused_and_leaves_the_run_untouched(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    files = {p: p.read_bytes() for p in [run / "config.yaml", run / "eval.json", Path(r["checkpoint"])]}
    assert main(["train", f"train.resume={r['checkpoint']}", "train.total_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: train.resume: {r['checkpoint']} is at step 400, past train.total_steps=2; "
                   "raise train.total_steps to train on (vitflow eval evaluates it)")
    assert all(p.read_bytes() == data for p, data in files.items())


def test_checkpoint_write_killed_midway_keeps_previous(tmp_path, monkeypatch):
    path1 = ckpt.save_checkpoint({"step": 1, "model": {"w": torch.ones(3)}}, ckpt.checkpoint_path(tmp_path, 1))

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt  # the process is interrupted while writing

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint({"step": 2}, ckpt.checkpoint_path(tmp_path, 2))
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path) == [path1]
    assert ckpt.load_checkpoint(tmp_path)["step"] == 1
    truncated = tmp_path / "checkpoints" / "step-00000003.pt"
    truncated.write_bytes(path1.read_bytes()[:100])
    with pytest.raises(ValueError, match="step-00000003.pt"):
        ckpt.load_checkpoint(truncated)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run_bitwise(tmp_path):
    """A real SIGKILL after step k, resume, step 2k: identical parameters (CPU, same thread count:
    bitwise, because batches, augmentations, dropout and the optimizer state are all restored)."""
    data = make_folder(tmp_path / "data", per_class=16, size=12)
    k, env = 6, {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_train_cmd(full, data, 2 * k, f"train.checkpoint_every={k}"), check=True, env=env,
                   capture_output=True)
    killed = tmp_path / "killed"
    first = kill_at_first_checkpoint(_train_cmd(killed, data, 2 * k, f"train.checkpoint_every={k}"), killed, env)
    assert first and ckpt.load_checkpoint(first[0])["step"] == k
    for p in first[1:]:  # anything written after step k would also be complete: drop it to resume at k
        p.unlink()
    subprocess.run(_train_cmd(killed, data, 2 * k, "train.resume=auto", f"train.checkpoint_every={k}"), check=True,
                   env=env, capture_output=True)
    a = ckpt.load_checkpoint(ckpt.checkpoint_path(full, 2 * k))
    b = ckpt.load_checkpoint(ckpt.checkpoint_path(killed, 2 * k))
    assert a["step"] == b["step"] == 2 * k
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["data"]["position"] == b["data"]["position"]
    changed = ckpt.load_checkpoint(ckpt.checkpoint_path(full, k))["model"]["head.weight"]
    assert not torch.equal(changed, a["model"]["head.weight"])  # training did move the weights


def test_resume_rejects_other_classes(tmp_path):
    run = tmp_path / "run"
    Trainer(digits_config(run, "train.total_steps=2")).fit()
    data = make_folder(tmp_path / "data", per_class=4)
    cfg = build_config(overrides=[f"train.run_dir={run}", "train.resume=auto", f"data.path={data}",
                                  "data.source=folder", "data.train_split=train[:50%]",
                                  "data.test_split=train[50%:]"])
    with pytest.raises(ValueError, match="classes"):
        Trainer(cfg)


def test_resume_keeps_the_fp32_gemm_of_the_run(tmp_path):
    """A resumed run multiplies with the GEMM its first process chose (vitflow.models.kernels.onednn), so
    that it rounds as an uninterrupted run would even where a new timing would choose the other."""
    run = tmp_path / "run"
    with onednn.forced("torch"):
        Trainer(digits_config(run, "train.total_steps=2")).fit()
    assert ckpt.load_checkpoint(run)["fp32_gemm"] == "torch"
    with onednn.forced("onednn"):
        Trainer(digits_config(run, "train.total_steps=4", "train.resume=auto")).fit()
        assert onednn.decided() == "torch"
    assert ckpt.load_checkpoint(run)["step"] == 4 and ckpt.load_checkpoint(run)["fp32_gemm"] == "torch"


def test_resume_warns_about_changed_config(caplog):
    from vitflow.training.run.resume import warn_config_changes

    saved = build_config(overrides=["train.run_dir=a"]).to_dict()
    with caplog.at_level("WARNING", logger="vitflow.training.loop"):
        warn_config_changes(saved, build_config(overrides=["train.run_dir=b", "train.resume=auto"]).to_dict(), Path("c.pt"))
        assert not caplog.records  # where the run lives is not a change of what it trains
        warn_config_changes(saved, build_config(overrides=["train.batch_size=64", "optim.lr=0.5"]).to_dict(), Path("c.pt"))
    msg = caplog.records[-1].getMessage()
    assert "c.pt" in msg and "optim.lr 0.003 -> 0.5" in msg and "train.batch_size 128 -> 64" in msg
    assert "run_dir" not in msg


def _kill_after(cmd, run, step, env):
    """Start ``cmd`` and SIGKILL it once ``run``'s metrics hold a train record of ``step``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        m = run / "metrics.jsonl"
        if m.is_file() and f'"kind": "train", "step": {step},' in m.read_text():
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]


@pytest.mark.slow
def test_records_after_a_kill_and_resume_equal_the_uninterrupted_run(tmp_path):
    """SIGKILL after the records of steps past the last checkpoint were written, then `vitflow
    resume RUN`: the records (every train / eval / epoch record and the summary, including the
    skipped-image counts of an unreadable training image) equal the uninterrupted run's, each step
    once; the CSV too; the weights bit for bit."""
    data = make_folder(tmp_path / "data", per_class=16, size=12)
    (data / "a" / "broken.png").write_bytes(b"not an image")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    extra = ("train.checkpoint_every=4", "train.log_every=1", "train.eval_every=6")
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_train_cmd(full, data, 14, *extra), check=True, env=env, capture_output=True)
    _kill_after(_train_cmd(killed, data, 14, *extra), killed, 10, env)
    assert ckpt.load_checkpoint(killed)["step"] == 8 and '"step": 10,' in (killed / "metrics.jsonl").read_text()
    out = subprocess.run([sys.executable, "-m", "vitflow", "resume", str(killed)], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = comparable_records(full), comparable_records(killed)
    assert [r["kind"] for r in b].count("epoch") == [r["kind"] for r in a].count("epoch") > 1
    assert b == a
    assert a[-1]["skipped_images"] > 0  # the broken image was skipped (and counted) in every epoch
    assert (killed / "metrics_train.csv").read_text().count("\n") == (full / "metrics_train.csv").read_text().count("\n")
    wa, wb = ckpt.load_checkpoint(full)["model"], ckpt.load_checkpoint(killed)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_restores_the_saved_config_and_lists_the_changes(tmp_path, caplog):
    run = tmp_path / "run"
    assert main(["train", "-q", "optim.lr=0.002", "model.drop_path_rate=0.05", "train.total_steps=4",
                 "train.checkpoint_every=2", "train.log_every=2", f"train.run_dir={run}"]) == 0
    with caplog.at_level("INFO", logger="vitflow"):
        assert main(["resume", str(run), "train.total_steps=6"]) == 0
    state = ckpt.load_checkpoint(run)
    assert state["step"] == 6 and state["config"]["optim"]["lr"] == 0.002  # restored, not the preset's
    assert state["config"]["model"]["drop_path_rate"] == 0.05
    assert "changed: train.resume 'none' -> 'auto'; train.total_steps 4 -> 6" in caplog.text
    assert f"resumed from {run}/checkpoints/step-00000004.pt at step 4" in caplog.text


def test_resume_auto_skips_an_unreadable_newest_checkpoint(tmp_path, caplog):
    run = tmp_path / "run"
    assert main(["train", "-q", "train.total_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=5",
                 f"train.run_dir={run}"]) == 0
    newest = ckpt.checkpoint_path(run, 4)
    newest.write_bytes(newest.read_bytes()[:1000])  # a killed copy
    with caplog.at_level("INFO", logger="vitflow"):
        assert main(["resume", str(run), "train.total_steps=5"]) == 0
    assert "skipping unreadable checkpoint" in caplog.text and "step-00000004.pt" in caplog.text
    assert "at step 2" in caplog.text and ckpt.load_checkpoint(run)["step"] == 5


def test_resume_auto_of_a_folder_that_does_not_exist_is_an_error(tmp_path, capsys):
    assert main(["resume", str(tmp_path / "runz")]) == 2
    assert "does not exist: there is no run to resume there (a typo?)" in capsys.readouterr().err
    assert not (tmp_path / "runz").exists()



def test_disk_full_stops_with_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    """Short of space before a checkpoint write, and a write that fails midway (ENOSPC): one line
    naming the folder, exit status 1, no temporary file, the previous checkpoint intact."""
    import errno
    import shutil as real_shutil

    run = tmp_path / "run"
    assert main(["train", "-q", "train.total_steps=2", "train.checkpoint_every=2", f"train.run_dir={run}"]) == 0
    before = snapshot(run / "checkpoints")
    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    assert main(["resume", str(run), "train.total_steps=4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: not enough space for checkpoint step-00000004.pt in ") and "MiB needed" in err
    assert f"vitflow resume {run}" in err
    assert snapshot(run / "checkpoints") == before
    monkeypatch.undo()

    class Full:  # a disk that fills up after 4 KiB of the checkpoint
        def __init__(self, path, mode):
            self.f, self.written = open(path, mode), 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(ckpt, "open", Full, raising=False)
    assert main(["resume", str(run), "train.total_steps=4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot write checkpoint step-00000004.pt" in err and "No space left on device" in err
    assert snapshot(run / "checkpoints") == before  # no temporary file, step 2 untouched
