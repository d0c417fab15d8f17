"""The training loop: a real run, epoch records, skipped-image counts, accumulation, progressive resizing."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import HYMENOPTERA_TAR, digits_config, encode, make_folder, need
from vitflow.cli import main
from vitflow.metrics.intervals import wilson
from vitflow.rundir import read_metrics
from vitflow.training import Trainer


def test_digits_run_learns_and_writes_run_dir(digits_run):
    run, r, _ = digits_run
    assert Path(r["checkpoint"]).name == "step-00000400.pt"
    recs = read_metrics(run / "metrics.jsonl")
    evals = [x for x in recs if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [200, 400]
    assert evals[-1]["top1"] == pytest.approx(r["test_top1"]) and evals[-1]["top1"] > evals[0]["top1"]
    trains = [x for x in recs if x["kind"] == "train"]
    assert len(trains) == 16 and trains[0]["loss"] > trains[-1]["loss"] + 0.5
    assert all(0 <= x["data_stall"] <= 1 and x["images_per_s"] > 0 for x in trains)
    # 1438 training images give 11 full batches of 128 an epoch: 400 steps = epochs 0..35 and 4 batches of 36
    epochs = [x for x in recs if x["kind"] == "epoch"]
    assert [x["epoch"] for x in epochs] == list(range(37)) and [x.get("partial") for x in epochs[-2:]] == [None, True]
    assert epochs[-1]["step"] == 400 and epochs[-1]["batches"] == 4
    assert sum(x["skipped_images"] for x in epochs) == r["skipped_images"] == 0
    assert (run / "config.yaml").read_text().count("vit_digits_patch2_8") == 1
    assert len(list((run / "samples").glob("*.png"))) == 10
    # each split's figure carries its 95% interval in the summary, eval.json, the log and the report
    ev = json.loads((run / "eval.json").read_text())
    assert r["test_top1_ci95"] == pytest.approx(list(wilson(round(r["test_top1"] * ev["images"]), ev["images"])))
    assert ev["top1_ci95"] == r["test_top1_ci95"] and ev["macro_f1_ci95"] == r["test_macro_f1_ci95"]
    low, high = r["test_top1_ci95"]
    assert f"test top-1 {r['test_top1']:.2%} [{low * 100:.1f}-{high * 100:.1f}]" in digits_run[2].stderr
    assert f"95% CI [{low * 100:.1f}-{high * 100:.1f}]" in (run / "report.html").read_text()


def test_every_epoch_gets_its_record_when_one_step_spans_several(tmp_path):
    """1,438 digits training images, micro-batches of 1,024: one batch an epoch, and each step's two
    micro-batches end two epochs. Every epoch gets its record after the step that ended it."""
    run = tmp_path / "run"
    Trainer(digits_config(run, "train.batch_size=2048", "train.accum_steps=2", "train.total_steps=2",
                 "optim.warmup_steps=0")).fit()
    epochs = [(x["epoch"], x["step"]) for x in read_metrics(run / "metrics.jsonl") if x["kind"] == "epoch"]
    assert epochs == [(0, 1), (1, 1), (2, 2), (3, 2)]


@pytest.mark.parametrize("max_in_memory", [0, 1000], ids=["files", "ram_cache"])
def test_unreadable_images_counted_per_split_and_same_in_eval_json_and_vitflow_eval(tmp_path, caplog, capsys,
                                                                                  max_in_memory):
    """A bad train image counts in every training epoch, a bad test image in every evaluation and
    never in an epoch; eval.json, the summary and `vitflow eval` agree, with or without the RAM cache."""
    data = make_folder(tmp_path / "data", per_class=5, split="train")
    make_folder(tmp_path / "data", per_class=3, split="test", seed=1)
    (data / "train" / "a" / "truncated.jpg").write_bytes(encode(np.zeros((8, 8, 3), np.uint8), "JPEG")[:40])
    (data / "test" / "b" / "empty.jpg").write_bytes(b"")  # 16 train images (2 batches of 8), 10 test
    run = tmp_path / "run"
    cfg = digits_config(run, f"data.path={data}", "data.source=folder", "data.train_split=train", "data.test_split=test",
               f"data.max_in_memory={max_in_memory}", "model.img_size=8", "train.batch_size=8",
               "train.total_steps=6", "train.eval_every=3", "optim.warmup_steps=2")
    with caplog.at_level("WARNING"):
        r = Trainer(cfg).fit()
    assert (r["skipped_images"], r["test_skipped"]) == (3, 1)  # 3 epochs x 1 train file; 1 test file
    recs = read_metrics(run / "metrics.jsonl")
    epochs = [(x["epoch"], x["step"], x["skipped_images"]) for x in recs if x["kind"] == "epoch"]
    assert epochs == [(0, 2, 1), (1, 4, 1), (2, 6, 1)]  # the run ends with epoch 2: it has its record
    assert [(x["step"], x["skipped"], x["images"]) for x in recs if x["kind"] == "eval"] == [(3, 1, 9), (6, 1, 9)]
    assert json.loads((run / "eval.json").read_text())["skipped"] == 1
    warned = [m.getMessage() for m in caplog.records if "unreadable image" in m.getMessage()]
    assert sum(str(data / "train" / "a" / "truncated.jpg") in m for m in warned) == 1  # once, in all epochs
    assert sum(str(data / "test" / "b" / "empty.jpg") in m for m in warned) == 1  # once, in all evaluations
    caplog.clear()
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        assert main(["eval", r["checkpoint"], "--json"]) == 0
    captured = capsys.readouterr()
    ev = json.loads(captured.out.strip().splitlines()[-1])
    assert (ev["test_skipped"], ev["test_images"]) == (1, 9) and "skipped 1 unreadable image(s)" in captured.err
    assert any(str(data / "test" / "b" / "empty.jpg") in m.getMessage() for m in caplog.records)


def test_photos_evaluated_in_training_score_as_vitflow_eval_reads_them(tmp_path, capsys):
    """The val photos of a run are cached in RAM at the eval resize, decoded in full (a training
    split's cache decodes large JPEGs at a reduced DCT scale): eval.json and `vitflow eval` (which
    reads the files) give the same figures."""
    run = tmp_path / "run"
    assert main(["-q", "train", f"data.path={need(HYMENOPTERA_TAR)}", "model.img_size=64", "train.total_steps=2",
                 "train.batch_size=16", "train.precision=fp32", "train.threads=1", f"train.run_dir={run}"]) == 0
    saved = json.loads((run / "eval.json").read_text())
    capsys.readouterr()
    assert main(["-q", "eval", str(run), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert saved["images"] == ev["val_images"] == 153
    assert saved["top1"] == ev["val_top1"] and abs(saved["loss"] - ev["val_loss"]) < 1e-5, (saved, ev)


def test_accumulation_equals_one_large_batch(tmp_path):
    """4 micro-batches of 8 then one step == one batch of 32 (fp32, no dropout): 1e-5."""
    params = []
    for accum in (1, 4):
        cfg = digits_config(tmp_path / f"acc{accum}", "train.batch_size=32", f"train.accum_steps={accum}",
                   "train.label_smoothing=0.1", "data.train_augment=none")  # augmentation draws are per batch
        tr = Trainer(cfg)
        it = iter(tr.loader)
        batches = [tr.epochs.fetch(it) for _ in range(accum)]
        if accum == 1:
            ref_images = batches[0]["images"]
        else:
            assert torch.equal(torch.cat([b["images"] for b in batches]), ref_images)
        tr.train_step(batches)
        params.append(torch.cat([p.detach().flatten() for p in tr.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=0)


def test_progressive_resizing_schedule_and_run(tmp_path):
    from vitflow.data.augment import progressive_resolution

    sizes = [progressive_resolution(s, 100, 16, 32, (0.2, 0.6), 4) for s in range(0, 101, 10)]
    assert sizes == [16, 16, 16, 20, 24, 28, 32, 32, 32, 32, 32]
    assert progressive_resolution(0, 10, 3, 8, (0.0, 1.0), 2) == 2  # rounded to the patch size, never below it
    run = tmp_path / "run"
    cfg = digits_config(run, "train.total_steps=40", "data.progressive_min_size=4", "data.progressive_ramp=[0.25,0.75]")
    tr = Trainer(cfg)
    costs = [tr.resizing.step_cost(s, 40) for s in (0, 20, 39)]
    assert costs == [4 / 16, 9 / 16, 1.0]  # 2x2, 3x3 and 4x4 patch grids of the 8 px digits (avg pool)
    r = tr.fit()
    res = [x["resolution"] for x in read_metrics(run / "metrics.jsonl") if x["kind"] == "train"]
    assert res == sorted(res) and res[0] == 4 and res[-1] == 8
    assert 0 <= r["test_top1"] <= 1
