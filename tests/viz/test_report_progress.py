"""The report tells the truth mid-run: every curve labelled with its split, "no evaluation yet, first
at step N (~M)" instead of empty axes, later ``vitflow eval`` results picked up, held-out samples
and attention maps for a folder run, and no top-5 under 6 classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import make_folder
from vitflow.cli import main
from vitflow.config import build_config
from vitflow.training import train
from vitflow.viz import report as report_module
from vitflow.viz.report import write_live_report, write_report


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory) -> tuple[Path, dict]:
    """A 6-step run on a 3-class image folder with a val split, evaluated at step 4 and the end."""
    root = tmp_path_factory.mktemp("report")
    data = make_folder(root / "data", per_class=8, size=16, split="train")
    make_folder(data, per_class=4, size=16, split="val", seed=1)
    run = root / "run"
    summary = train(build_config("photos-auto", overrides=[
        f"data.path={data}", f"train.run_dir={run}", "model.img_size=16", "model.patch_size=4", "model.depth=2",
        "train.total_steps=6", "train.eval_every=4", "train.checkpoint_every=4", "train.batch_size=8",
        "train.log_every=2"]))
    return run, summary


def before_first_evaluation(run: Path, to: Path) -> Path:
    """A copy of ``run`` as it stood before its first evaluation (its records up to then)."""
    shutil.copytree(run, to)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    first = next(i for i, x in enumerate(lines) if json.loads(x)["kind"] == "eval")
    (to / "metrics.jsonl").write_text("\n".join(lines[:first]) + "\n")
    (to / "eval.json").unlink()
    for p in (to / "checkpoints").glob("*.pt"):
        p.unlink()
    return to


def test_before_the_first_evaluation_the_page_says_when_it_comes(folder_run, tmp_path, monkeypatch):
    run, _ = folder_run
    early = before_first_evaluation(run, tmp_path / "early")
    titles = []
    real = report_module.line_plot
    monkeypatch.setattr(report_module, "line_plot", lambda path, title, series, *a, **k: (
        titles.append((title, [s[0] for s in series])), real(path, title, series, *a, **k))[1])
    page = write_live_report(early).read_text()
    assert "No evaluation yet, first at step 4 (~" in page and "after the start)." in page
    assert not (early / "report" / "accuracy.png").exists()  # no empty axes
    assert ("loss: training batches and the val split", ["train loss (training batches)"]) in titles
    assert "Run in progress" in page and "Last evaluation</h2><p>None yet" in page
    assert "Held-out samples (10 images" in page and "predicted" not in page  # the live page loads no model


def test_after_evaluations_every_curve_names_its_split_and_top5_is_gone(folder_run, tmp_path, monkeypatch):
    run, summary = folder_run
    titles = []
    real = report_module.line_plot
    monkeypatch.setattr(report_module, "line_plot", lambda path, title, series, *a, **k: (
        titles.append((title, [s[0] for s in series])), real(path, title, series, *a, **k))[1])
    page = write_report(run, tmp_path / "r.html").read_text()
    assert ("val top-1 at each evaluation", ["val top-1"]) in titles  # 3 classes: no top-5 curve
    assert ("loss: training batches and the val split", ["train loss (training batches)", "val loss"]) in titles
    assert "val_top5" not in summary and "top-5" not in page and "No evaluation yet" not in page
    samples = sorted(p.name for p in (run / "samples").iterdir())  # every class first, the files' own bytes
    assert len(samples) == 10 and {"00_a.png", "04_b.png", "08_c.png"} <= set(samples)
    assert page.count("predicted <b>") == 10 and "Attention maps: mean attention over patch tokens" in page


def test_vitflow_eval_results_are_picked_up(folder_run, tmp_path, capsys):
    run, _ = folder_run
    early = before_first_evaluation(run, tmp_path / "stopped")  # an interrupted run: no eval.json of its own
    shutil.copy(sorted((run / "checkpoints").glob("step-*.pt"))[-1], early / "checkpoints")
    ckpt = sorted((early / "checkpoints").glob("step-*.pt"))[-1]
    assert main(["eval", str(ckpt), "data.test_split=none"]) == 0
    out = capsys.readouterr().out
    assert "recorded for the run's report: " in out and "top-5" not in out
    record = json.loads(next((early / "evals").glob("step-*-val.json")).read_text())
    assert record["step"] == 6 and record["source"] == "vitflow eval" and "top5" not in record
    page = write_live_report(early).read_text()
    assert "Last evaluation by <code>vitflow eval</code>: step 6, val split" in page
    assert "Evaluations by <code>vitflow eval</code>" in page and f"top-1 {record['top1']:.2%}" in page
