"""The same images kept as a folder, a CSV label file, a Hugging Face dataset saved to disk or
Parquet files train the same run, bit for bit; a run with validation and test splits reports both,
labelled, and chooses only on the validation split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import cifar_subset, comparable_records, digits_config, rows_of, write_csv
from vitflow.checkpoint import load_checkpoint
from vitflow.rundir import read_metrics
from vitflow.training import train

SMALL = ("data.source=auto", "data.train_split=train", "data.test_split=auto", "model.img_size=32", "model.patch_size=8", "data.train_augment=pad_crop",
         "data.hflip=true", "data.crop_pct=1.0", "train.total_steps=12", "train.batch_size=16", "train.eval_every=6",
         "train.precision=fp32", "data.mixup_alpha=0.2")


def run(path: Path, run_dir: Path, *extra: str) -> tuple[dict, dict]:
    summary = train(digits_config(run_dir, f"data.path={path}", *SMALL, *extra))
    return summary, load_checkpoint(summary["checkpoint"])


def hf_dataset(folder: Path, out: Path, parquet: bool) -> Path:
    """The folder's images as a DatasetDict (``Image`` + ``ClassLabel`` columns, rows in path order),
    saved with ``save_to_disk`` or as Hub-style Parquet files."""
    datasets = pytest.importorskip("datasets")
    classes = sorted(p.name for p in (folder / "train").iterdir())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    splits = {}
    for split in ("train", "test"):
        files = sorted((folder / split).rglob("*.jpg"))
        splits[split] = datasets.Dataset.from_dict(
            {"image": [{"bytes": f.read_bytes(), "path": f.name} for f in files],
             "label": [classes.index(f.parent.name) for f in files]}, features=features)
    if not parquet:
        datasets.DatasetDict(splits).save_to_disk(str(out))
        return out
    for split, ds in splits.items():
        (out / "data").mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(out / "data" / f"{split}-00000-of-00001.parquet"))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return cifar_subset(tmp_path_factory.mktemp("forms") / "imgs")


@pytest.fixture(scope="module")
def folder_run(folder: Path, tmp_path_factory):
    return run(folder, tmp_path_factory.mktemp("runs") / "folder")


@pytest.mark.parametrize("form", ["csv", "hf save_to_disk", "parquet"])
def test_same_images_same_run(folder: Path, folder_run, form: str, tmp_path: Path):
    if form == "csv":
        path = write_csv(tmp_path / "labels.csv", [{**r, "path": str(folder / r["path"])} for r in rows_of(folder)])
    else:
        path = hf_dataset(folder, tmp_path / "hf", parquet=form == "parquet")
    summary, state = run(path, tmp_path / "run")
    ref_summary, ref_state = folder_run
    assert state["classes"] == ref_state["classes"]
    for k, v in ref_state["model"].items():
        assert torch.equal(state["model"][k], v), k  # bit-identical weights
    assert comparable_records(Path(summary["run_dir"])) == comparable_records(Path(ref_summary["run_dir"]))
    assert summary["test_top1"] == ref_summary["test_top1"] and summary["step"] == 12


def test_val_and_test_reported_and_only_val_chooses(folder: Path, tmp_path: Path):
    rows = rows_of(folder)
    val = [r for r in rows if r["split"] == "train"][:40]
    for r in val:
        r["split"] = "valid"
    path = write_csv(folder / "three.csv", rows)
    summary, state = run(path, tmp_path / "run", "train.checkpoint_every=6")
    evals = [r for r in read_metrics(Path(summary["run_dir"])) if r["kind"] == "eval"]
    assert [(r["step"], r["split"]) for r in evals] == [(6, "val"), (12, "val"), (12, "test")]
    assert evals[0]["split_expr"] == "valid" and evals[-1]["images"] == 60 and evals[1]["images"] == 40
    assert summary["val_top1"] == evals[1]["top1"] and summary["test_top1"] == evals[2]["top1"]
    assert state["metrics"]["top1"] == evals[1]["top1"]  # the checkpoint keeps the val figures it was chosen by
    ev = json.loads((Path(summary["run_dir"]) / "eval.json").read_text())
    assert ev["split"] == "test" and ev["images"] == 60


def test_multilabel_threshold_from_val_only(tmp_path: Path):
    from helpers import cifar_mosaics

    labels = cifar_mosaics(tmp_path / "mosaics", (("train", 96), ("val", 48), ("test", 48)))
    summary, state = run(labels, tmp_path / "run", "data.task=multilabel", "model.img_size=64", "data.mixup_alpha=0")
    evals = [r for r in read_metrics(Path(summary["run_dir"])) if r["kind"] == "eval"]
    assert [r["split"] for r in evals] == ["val", "val", "test"]
    assert state["task"] == "multilabel" and state["threshold"] == evals[1]["threshold"] == summary["val_threshold"]
    assert evals[2]["threshold"] == state["threshold"] == summary["test_threshold"]  # applied to test, not chosen
    assert 0 <= summary["test_map"] <= 1 and {"test_micro_f1", "test_macro_f1", "val_map"} <= set(summary)
