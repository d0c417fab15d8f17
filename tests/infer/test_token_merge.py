"""``vitflow merge-tokens``: the checkpoint with token merging in its ``model_args``, its guard's
figures, and the commands downstream (predict, export verified on real images) running the merged
model; a drop past ``--max-drop`` writes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.infer.calibration import calibration_images


@pytest.mark.slow
def test_merged_checkpoint_runs_merged_everywhere(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    out = tmp_path / "merged.pt"
    assert main(["merge-tokens", str(run), "-o", str(out), "-r", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["r"] == 2 and r["curve"][0]["r"] == 2 and r["images"] > 0
    assert r["drop_points"] == pytest.approx((r["before"] - r["after"]) * 100, abs=1e-3)
    assert r["speedup_throughput"] > 0 and set(r["timing"]) == {"unmerged", "merged"}

    state = load_checkpoint(out)
    assert state["model_args"]["token_merge"] == 2 and state["token_merging"]["r"] == 2
    merged, plain = model_from_checkpoint(state).eval(), model_from_checkpoint(load_checkpoint(run)).eval()
    assert merged.token_merge == 2 and plain.token_merge == 0
    x = calibration_images(None, _pp(state), list(state["classes"]), state, 16, split="test")
    plain.set_token_merge(2)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), plain(x))  # the same weights, merged as the guard measured

    onnx = tmp_path / "merged.onnx"
    assert main(["export", str(out), "-o", str(onnx), "--json"]) == 0  # verified against the merged PyTorch model
    exported = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert exported["ok"] is True and exported["images"] > 0
    # INT8 of the merged graph (ONNX Runtime's symbolic shape inference cannot follow the merge: its fallback)
    assert main(["quantize", str(out), "-o", str(tmp_path / "merged.int8.onnx")]) == 0
    capsys.readouterr()
    # merging a merged checkpoint again measures from the unmerged model, not from the merged one
    assert main(["merge-tokens", str(out), "-o", str(tmp_path / "again.pt"), "-r", "3", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["before"] == r["before"] and load_checkpoint(tmp_path / "again.pt")["model_args"]["token_merge"] == 3


def test_no_r_within_the_drop_writes_nothing(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    out = tmp_path / "merged.pt"
    assert main(["merge-tokens", str(run), "-o", str(out), "--max-drop", "-100"]) != 0
    err = capsys.readouterr().err
    assert "NOT written" in err and len(err.strip().splitlines()) <= 12 and not out.exists()


def _pp(state):
    from vitflow.data.transforms import Preprocess

    return Preprocess.from_dict(state["preprocess"])
