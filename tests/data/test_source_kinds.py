"""The source-kind table: a new kind is one module (here, this file's toy ``.npz`` kind) and one
row of :data:`vitflow.data.sources.table.KINDS`; training, evaluation during it (split names
from the kind), the final test and ``vitflow eval`` then work for it unchanged."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vitflow.cli import CONFIG_CHECKS, main
from vitflow.config import ConfigError, DataConfig, build_config
from vitflow.data import DataError
from vitflow.data.sources import table
from vitflow.data.sources.base import TensorSource
from vitflow.data.sources.digits import digits_source
from vitflow.data.sources.dispatch import kind_of, open_split, resolve_eval_splits, source_kind, split_names
from vitflow.data.sources.kind import SourceKind, relabel

# --- the toy kind's module: a .npz holding classes, and SPLIT_images (uint8 (n, 3, H, W)) + SPLIT_labels ---


def is_npz(path: Path) -> bool:
    return path.is_file() and path.suffix == ".npz"


def npz_splits(where: Path, cfg: DataConfig) -> list[str]:
    with np.load(where) as z:
        return [k.removesuffix("_images") for k in z.files if k.endswith("_images")]


def open_npz(where: Path, split: str, classes: list[str] | None, cfg: DataConfig) -> TensorSource:
    with np.load(where) as z:
        if f"{split}_images" not in z.files:
            raise DataError(f"split {split!r} not in {where}; it has: {', '.join(npz_splits(where, cfg))}")
        src = TensorSource([str(c) for c in z["classes"]], z[f"{split}_labels"].astype(np.int64),
                           torch.from_numpy(z[f"{split}_images"]), f"{where}[{split}]")
    return relabel(src, classes)


TOY = SourceKind("toy", "a .npz of images and labels", npz_splits, open_npz, detect=is_npz, what="toy .npz file")

# --- the test ---

SPLITS = {"train": slice(0, 1300), "validation": slice(1300, 1550), "test": slice(1550, None)}


@pytest.fixture
def toy_kind(monkeypatch):
    """The toy kind as a row of the table, before the image folder and the tar (for this test only)."""
    monkeypatch.setattr(table, "KINDS", (*table.KINDS[:-2], TOY, *table.KINDS[-2:]))


@pytest.fixture(scope="module")
def digits_npz(tmp_path_factory) -> Path:
    """The embedded digits (1,797 real 8x8 scans) as a toy ``.npz`` with train / validation / test."""
    d = digits_source()
    order = np.random.default_rng(0).permutation(len(d))
    images, labels = d.images.numpy()[order], d.labels[order]
    path = tmp_path_factory.mktemp("toy") / "digits.npz"
    np.savez(path, classes=np.array(d.classes), **{f"{s}_images": images[sl] for s, sl in SPLITS.items()},
             **{f"{s}_labels": labels[sl] for s, sl in SPLITS.items()})
    return path


def test_a_registered_kind_is_detected_listed_and_opened(toy_kind, digits_npz):
    assert source_kind(digits_npz) == "toy" and kind_of(digits_npz, "toy") is TOY
    assert split_names(digits_npz) == ["train", "validation", "test"]
    cfg = DataConfig(path=str(digits_npz))
    assert resolve_eval_splits(cfg) == ("validation", "test")  # val_split=auto finds the kind's own name
    val = open_split(digits_npz, "val", classes=[str(c) for c in range(10)])  # val finds "validation"
    whole = digits_source()
    order = np.random.default_rng(0).permutation(len(whole))[SPLITS["validation"]]
    assert len(val) == 250 and np.array_equal(val.labels, whole.labels[order])
    assert torch.equal(val.load(7), whole.load(int(order[7])))
    half = open_split(digits_npz, "train[:50%]")  # slices as for every kind
    assert len(half) == 650
    with pytest.raises(DataError, match=r"is not a toy \.npz file$"):
        open_split(digits_npz.parent, "train", source="toy")  # a folder: the toy detector says no
    build_config(overrides=["data.source=toy", f"data.path={digits_npz}"], checks=CONFIG_CHECKS)


def test_the_configuration_reference_lists_the_registered_kinds(toy_kind):
    hooks_py = Path(__file__).parents[2] / "docs" / "hooks.py"
    spec = importlib.util.spec_from_file_location("vitflow_docs_hooks_kinds", hooks_py)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    (row,) = [line for line in hooks.config_reference().splitlines() if line.startswith("| `data.source` |")]
    assert "`labels` \\| `toy` \\| `folder` \\| `tar` |" in row  # the choices, in the table's order
    assert "`toy`: a .npz of images and labels; `folder`:" in row


def test_unknown_kinds_are_refused_with_the_nearest_name(digits_npz):
    with pytest.raises(ConfigError, match=r"^data\.source='label' is invalid: choose one of \['auto', 'digits', "
                                          r"'wds', .*'tar'\]; did you mean 'labels'\? \(in command line\)$"):
        build_config(overrides=["data.source=label", f"data.path={digits_npz}"], checks=CONFIG_CHECKS)
    with pytest.raises(ConfigError, match=r"data\.source='fodler' is invalid: .*did you mean 'folder'\?"):
        build_config(overrides=["data.source=fodler"], checks=CONFIG_CHECKS)  # before data.path's own check
    with pytest.raises(DataError, match=r"data\.source='toy' is invalid"):  # not in the table (no fixture)
        open_split(digits_npz, "train", source="toy")
    with pytest.raises(ConfigError, match=r"data\.access='stream' is invalid: must be random unless data\.source is "
                                          r"wds or tar"):
        build_config(overrides=["data.source=folder", "data.path=x", "data.access=stream"], checks=CONFIG_CHECKS)


def test_a_registered_kind_trains_evaluates_and_evals_end_to_end(toy_kind, digits_npz, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--preset", "digits-vit-tiny", "data.source=toy", f"data.path={digits_npz}",
                 "data.train_split=train", "data.val_split=auto", "data.test_split=auto", "train.total_steps=150",
                 "train.eval_every=75", "train.log_every=75", f"train.run_dir={run}", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["step"] == 150 and 0.3 < r["test_top1"] <= 1.0  # 10 classes: chance is 0.1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["split"], e["split_expr"], e["images"]) for e in records if e.get("kind") == "eval"]
    # evaluated during training on the kind's own "validation" split, then once on its test split
    assert evals == [(75, "val", "validation", 250), (150, "val", "validation", 250), (150, "test", "test", 247)]
    assert main(["eval", str(run), "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["test_images"] == 247 and e["test_top1"] == pytest.approx(r["test_top1"])
