"""Training and evaluating from WebDataset shards: a SIGKILLed run resumed mid-epoch ends with
bit-identical weights, and the evaluator scores the shards' val split as it scores the folder's."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import kill_at_first_checkpoint, make_folder
from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.evaluation import split_results


def _train_cmd(run_dir, data, steps, *extra):
    return [sys.executable, "-m", "vitflow", "train", f"data.path={data}", "data.num_workers=2",
            "data.shuffle_buffer=16", "data.hflip=true", "model.img_size=8", "model.drop_path_rate=0.1",
            "train.batch_size=8", f"train.total_steps={steps}", f"train.run_dir={run_dir}",
            "train.keep_checkpoints=100", "train.precision=fp32", "train.threads=1", "train.eval_interval=null",
            "train.live_report=false", *extra]


def _json_line(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_from_shards_matches_uninterrupted_run_bitwise(tmp_path, capsys):
    folder = make_folder(tmp_path / "folder", per_class=12, size=12, split="train")
    make_folder(tmp_path / "folder", per_class=4, size=12, split="val", seed=1)
    shards = tmp_path / "shards"
    assert main(["prepare", str(folder), str(shards), "--format", "wds", "--shard-size", "10"]) == 0
    k, env = 5, {**os.environ, "PYTHONUNBUFFERED": "1"}  # 36 samples: 4 batches an epoch; step 5 is mid-epoch 1
    full = tmp_path / "full"  # uninterrupted, in this process (one start-up less)
    assert main(_train_cmd(full, shards, 2 * k, f"train.checkpoint_every={k}")[3:]) == 0
    killed = tmp_path / "killed"
    first = kill_at_first_checkpoint(_train_cmd(killed, shards, 2 * k, f"train.checkpoint_every={k}"), killed, env)
    assert first and ckpt.load_checkpoint(first[0])["step"] == k
    assert ckpt.load_checkpoint(first[0])["data"]["position"] == [1, 1]  # mid-epoch: epoch 1, next batch 1
    for p in first[1:]:
        p.unlink()
    subprocess.run(_train_cmd(killed, shards, 2 * k, "train.resume=auto", f"train.checkpoint_every={k}"),
                   check=True, env=env, capture_output=True)
    a = ckpt.load_checkpoint(ckpt.checkpoint_path(full, 2 * k))
    b = ckpt.load_checkpoint(ckpt.checkpoint_path(killed, 2 * k))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["data"]["position"] == b["data"]["position"] == [2, 2]
    assert not torch.equal(ckpt.load_checkpoint(ckpt.checkpoint_path(full, k))["model"]["head.weight"],
                           a["model"]["head.weight"])  # training did move the weights

    capsys.readouterr()
    assert main(["eval", str(full), "--json"]) == 0  # the run's data: the shards' val split
    from_shards = _json_line(capsys.readouterr().out)
    assert main(["eval", str(full), "--json", f"data.path={folder}", "data.source=auto"]) == 0
    from_folder = _json_line(capsys.readouterr().out)
    a, b = split_results(from_shards)["val"], split_results(from_folder)["val"]
    assert a["images"] == b["images"] == 12 and a["skipped"] == 0
    assert a["loss"] == b["loss"] and a["top1"] == b["top1"] and a.get("top5") == b.get("top5")
