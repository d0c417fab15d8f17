"""A run directory belongs to one run: reused folders refused untouched, nothing left by a failed
start, unfinished checkpoint writes cleaned at the next start."""

import shutil

from helpers import snapshot
from vitflow import checkpoint as ckpt
from vitflow.cli import main


def test_a_new_run_refuses_another_runs_folder_and_touches_nothing(digits_run, tmp_path, capsys):
    run = shutil.copytree(digits_run[0], tmp_path / "run")  # a copy: other tests read and evaluate the shared run
    before = snapshot(run)
    assert main(["train", "train.total_steps=2", f"train.run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert f"train.run_dir={run} holds another run" in err and f"vitflow resume {run}" in err
    assert snapshot(run) == before


def test_a_new_run_refuses_a_folder_of_the_users_and_touches_nothing(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    (folder / "config.yaml").write_text("mine: true\n")
    before = snapshot(folder)
    assert main(["train", "train.total_steps=2", f"train.run_dir={folder}"]) == 2
    err = capsys.readouterr().err
    assert "is not empty (config.yaml, notes.txt) and is not a vitflow run" in err
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["config.yaml", "notes.txt"]


def test_an_empty_folder_is_taken_and_a_failed_start_leaves_no_folder(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "-q", "train.total_steps=2", f"train.run_dir={empty}"]) == 0
    assert (empty / "run.json").is_file() and ckpt.latest_checkpoint(empty) is not None
    bad = tmp_path / "bad"
    assert main(["train", "--preset", "cifar10-vit-tiny", f"data.path={tmp_path / 'nope'}",
                 f"train.run_dir={bad}"]) == 2
    assert "does not exist" in capsys.readouterr().err and not bad.exists()


def test_an_unfinished_checkpoint_write_is_removed_at_the_next_start(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "-q", "train.total_steps=2", f"train.run_dir={run}"]) == 0
    orphan = run / "checkpoints" / ".step-00000003.pt.tmp"
    orphan.write_bytes(b"half a checkpoint")
    assert main(["resume", str(run), "train.total_steps=3"]) == 0
    assert not orphan.exists() and [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000002.pt",
                                                                                   "step-00000003.pt"]
