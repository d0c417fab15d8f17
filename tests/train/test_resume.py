"""Resume: refused past the end, atomic checkpoints, bit-identical resume after SIGKILL, changed classes and config."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import digits_config, make_folder
from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.config import build_config
from vitflow.train import Trainer


def _train_cmd(run_dir, data, steps, *extra):
    return [sys.executable, "-m", "vitflow", "train", f"data.path={data}", "data.source=folder",
            "data.train_split=train[:75%]", "data.test_split=train[75%:]", "data.num_workers=2", "data.hflip=true",
            "model.img_size=8", "model.drop_path_rate=0.1", "model.drop_rate=0.1", "train.batch_size=8",
            f"train.total_steps={steps}", f"train.run_dir={run_dir}", "train.keep_checkpoints=100",
            "train.precision=fp32", "train.threads=1", *extra]


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


def test_sigkill_then_resume_matches_uninterrupted_run_bitwise(tmp_path):
    """A real SIGKILL after step k, resume, step 2k: identical parameters (CPU, same thread count:
    bitwise, because batches, augmentations, dropout and the optimizer state are all restored)."""
    data = make_folder(tmp_path / "data", per_class=16, size=12)
    k, env = 6, {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_train_cmd(full, data, 2 * k, f"train.checkpoint_every={k}"), check=True, env=env,
                   capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(killed, data, 2 * k, f"train.checkpoint_every={k}"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not ckpt.list_checkpoints(killed) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    first = ckpt.list_checkpoints(killed)
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


def test_resume_warns_about_changed_config(caplog):
    from vitflow.train.resume import warn_config_changes

    saved = build_config(overrides=["train.run_dir=a"]).to_dict()
    with caplog.at_level("WARNING", logger="vitflow.train.loop"):
        warn_config_changes(saved, build_config(overrides=["train.run_dir=b", "train.resume=auto"]), Path("c.pt"))
        assert not caplog.records  # where the run lives is not a change of what it trains
        warn_config_changes(saved, build_config(overrides=["train.batch_size=64", "optim.lr=0.5"]), Path("c.pt"))
    msg = caplog.records[-1].getMessage()
    assert "c.pt" in msg and "optim.lr 0.003 -> 0.5" in msg and "train.batch_size 128 -> 64" in msg
    assert "run_dir" not in msg
