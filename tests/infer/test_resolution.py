"""``vitflow bench resolution``: the row at the checkpoint's own size is ``vitflow eval``; a row at
another size is the model fine-tuning at that size starts from (position tables resampled by the
same loader); sizes a model cannot take are skipped; the peak-memory figure is the live tensor
bytes; the CLI writes a table, a PNG and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import digits_config


def _fine_tuning_start(checkpoint, size: int, setup) -> dict:
    """The model ``vitflow train model.pretrained=CHECKPOINT model.img_size=SIZE`` starts from
    (create_model(..., pretrained=...)), scored on the same split with the checkpoint's preprocessing at SIZE."""
    from dataclasses import replace

    from vitflow.infer.evaluate import score
    from vitflow.models import create_model

    args = dict(setup.state["model_args"])
    model = create_model(**{**args, "img_size": size}, pretrained=str(checkpoint)).eval()
    return score(setup, model, replace(setup.preprocess, image_size=size))


def test_rows_are_vitflow_eval_at_that_size_and_the_fine_tuning_start(tiny_run, capsys):
    from vitflow.checkpoint import latest_checkpoint
    from vitflow.cli import main
    from vitflow.infer.bench.resolution import bench_resolution
    from vitflow.infer.evaluate import eval_setup

    run, _ = tiny_run
    said = []
    r = bench_resolution(run, [12, 8, 7, 4], batch_size=8, repeats=1, min_time=0.01, say=said.append)
    assert [row["size"] for row in r["rows"]] == [4, 8, 12] and r["trained_size"] == 8
    assert r["skipped"] == [{"size": 7, "reason": "img_size 7 is not a multiple of patch_size 2"}]
    assert "size 7: skipped: img_size 7 is not a multiple of patch_size 2" in said
    assert main(["eval", str(run), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    own = r["rows"][1]
    assert (own["top1"], own["top5"], own["loss"], own["images"]) == (ev["test_top1"], ev["test_top5"],
                                                                       ev["test_loss"], ev["test_images"])
    setup = eval_setup(run)
    for row in (r["rows"][0], r["rows"][2]):  # the learned pos_embed resampled from 4x4 to 2x2 / 6x6 patches
        start = _fine_tuning_start(latest_checkpoint(run), row["size"], setup)
        assert (row["top1"], row["loss"]) == (start["top1"], start["loss"])
    assert main(["eval", str(run), "--json", "model.img_size=12"]) == 0  # eval at another size: the same row
    at12 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert at12["image_size"] == 12 and (at12["test_top1"], at12["test_loss"]) == (r["rows"][2]["top1"],
                                                                                   r["rows"][2]["loss"])
    assert all(row["images_per_s"] > 0 and row["peak_memory_mib"] > 0 for row in r["rows"])
    assert r["rows"][0]["peak_memory_mib"] < r["rows"][2]["peak_memory_mib"]  # 4 vs 36 tokens


def test_swin_rows_use_the_fine_tuning_window_tables(tmp_path):
    """Swin at 8 px has 4x4, 2x2, 1x1 stage grids (windows clipped to them); at 16 px the second
    stage's window grows 2 -> 4, so its relative position tables are resampled. (24 channels and 90 test
    images keep it fast.)"""
    from vitflow.checkpoint import latest_checkpoint
    from vitflow.infer.bench.resolution import bench_resolution
    from vitflow.infer.evaluate import eval_setup
    from vitflow.training import train

    run = tmp_path / "swin"
    train(digits_config(run, "model.name=swin_cifar_patch2_window4_32", "model.img_size=8", "model.embed_dim=24",
                        "data.test_split=train[80%:85%]", "train.total_steps=3",
                        "train.batch_size=32", "train.eval_every=0", "train.log_every=3", "optim.warmup_steps=1"))
    r = bench_resolution(run, [8, 16], batch_size=8, repeats=1, min_time=0.01, say=lambda m: None)
    assert [row["size"] for row in r["rows"]] == [8, 16] and r["model"] == "swin_cifar_patch2_window4_32"
    setup = eval_setup(run)
    start = _fine_tuning_start(latest_checkpoint(run), 16, setup)
    assert (r["rows"][1]["top1"], r["rows"][1]["loss"]) == (start["top1"], start["loss"])
    assert r["rows"][0]["loss"] != r["rows"][1]["loss"]


def test_peak_memory_counts_weights_input_and_the_live_intermediates():
    from vitflow.infer.bench.resolution import inference_peak_bytes

    model = torch.nn.Sequential(torch.nn.Linear(512, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 512)).eval()
    x = torch.randn(64, 512)
    weights = sum(p.numel() * 4 for p in model.parameters())
    with torch.inference_mode():
        peak = inference_peak_bytes(model, x, model)
    # fc1's output and GELU's output (64 x 4096 fp32 each) are alive together; then fc1's is freed
    assert peak == weights + x.numel() * 4 + 2 * 64 * 4096 * 4


def test_no_size_fits_is_one_clear_error(tiny_run):
    from vitflow.infer.bench.resolution import bench_resolution

    with pytest.raises(ValueError, match=r"vit_digits_patch2_8 takes none of the sizes \[5, 7\]: 5: img_size 5 is "
                                         "not a multiple of patch_size 2"):
        bench_resolution(tiny_run[0], [7, 5], say=lambda m: None)


def test_cli_table_plot_json_and_a_comparison_run(tiny_run, tmp_path, capsys):
    from vitflow.cli import main

    run, _ = tiny_run
    png = tmp_path / "res.png"
    assert main(["bench", "resolution", str(run), "--sizes", "6,8", "--compare", str(run), "--repeats", "1",
                 "--min-time", "0.01", "--batch-size", "8", "-o", str(png), "--json", "train.precision=fp32", "data.test_split=train[80%:85%]"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out.strip().splitlines()[-1])
    assert len(result["runs"]) == 2 and result["plot"] == str(png)
    a, b = result["runs"]
    assert [r["top1"] for r in a["rows"]] == [r["top1"] for r in b["rows"]]  # the same checkpoint twice
    assert "<- trained size" in out.err and " size   top-1" in out.err  # the table (stdout goes to stderr)
    with Image.open(png) as im:
        assert im.size == (576, 324)
        colours = np.unique(np.asarray(im.convert("RGB")).reshape(-1, 3), axis=0)
        assert len(colours) > 50  # lines, labels and legend drawn, not a blank canvas


def test_a_one_token_window_table_resamples_to_its_constant():
    """A Swin stage whose grid is 1x1 at the trained size has a window of one token: a table of one
    offset. Fitted to a larger window (fine-tuning or benchmarking at a larger size) every offset
    takes that value (it used to divide by zero: NaN logits)."""
    from vitflow.models.pretrained.swin_fit import resample_swin_table

    table = torch.tensor([[0.5, -2.0, 3.0]])
    out = resample_swin_table(table, (2, 2))
    assert out.shape == (9, 3) and torch.equal(out, table.expand(9, 3))
