"""Every command that reads a run directory takes its newest *readable* checkpoint, with the
resume's warning (``vitflow.checkpoint.load_checkpoint``); an explicit checkpoint that cannot be
read stays an error that names the run's readable ones."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from vitflow import checkpoint as ckpt
from vitflow.cli import main


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory):
    """A 4-step digits run with checkpoints at steps 2 and 4, the newest cut in half."""
    run = tmp_path_factory.mktemp("cut") / "run"
    assert main(["train", "-q", "train.total_steps=4", "train.checkpoint_every=2", "train.eval_every=0",
                 f"train.run_dir={run}"]) == 0
    newest = ckpt.checkpoint_path(run, 4)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    return run, newest


def _warned(caplog, newest) -> bool:
    return f"skipping unreadable checkpoint {newest}" in caplog.text and "trying the one before it" in caplog.text


def test_eval_predict_and_embed_take_the_newest_readable_checkpoint(cut_run, tmp_path, capsys, caplog):
    run, newest = cut_run
    with caplog.at_level(logging.WARNING):
        assert main(["eval", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["checkpoint"].endswith("step-00000002.pt") and _warned(caplog, newest)
    assert main(["eval", str(ckpt.checkpoint_path(run, 2)), "--json"]) == 0  # the same weights' figures
    reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: v for k, v in result.items() if k != "images_per_s"} == \
           {k: v for k, v in reference.items() if k != "images_per_s"}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["predict", str(run), str(run / "samples"), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == len(list((run / "samples").iterdir())) and _warned(caplog, newest)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main(["embed", str(run), str(run / "samples"), "-o", str(tmp_path / "f.npy")]) == 0
    assert np.load(tmp_path / "f.npy").shape[0] == len(lines) and _warned(caplog, newest)


@pytest.mark.parametrize("command", [
    ["export", "{run}", "--format", "torchscript", "-o", "{tmp}/m.ts"],
    ["quantize", "{run}", "--backend", "torch", "--dtype", "bf16", "-o", "{tmp}/q.pt"],
    ["report", "{run}", "-o", "{tmp}/r.html"],
    ["bench", "infer", "{run}", "--paths", "eager_fp32", "--repeats", "1", "--latency-calls", "1", "--min-time",
     "0.01", "--batch-size", "2"],
], ids=["export", "quantize", "report", "bench-infer"])
def test_export_quantize_report_and_bench_infer_take_it_too(cut_run, tmp_path, command, caplog):
    run, newest = cut_run
    with caplog.at_level(logging.WARNING):
        assert main([a.format(run=run, tmp=tmp_path) for a in command]) == 0
    assert _warned(caplog, newest) and (command[0] == "bench" or any(tmp_path.iterdir()))


def test_an_explicit_unreadable_checkpoint_is_an_error_naming_the_readable_ones(cut_run, capsys):
    run, newest = cut_run
    assert main(["eval", str(newest)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot read checkpoint {newest}") and len(err.splitlines()) == 1
    assert err.endswith("; readable checkpoints of this run: step-00000002.pt")
    assert main(["eval", str(run), "--checkpoint", newest.name]) == 2
    assert "readable checkpoints of this run: step-00000002.pt" in capsys.readouterr().err


def test_a_run_whose_checkpoints_are_all_unreadable_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt.checkpoint_path(run, 2).write_bytes(b"garbage")
    assert main(["eval", str(run)]) == 2
    assert f"no readable checkpoint in run directory {run}" in capsys.readouterr().err
