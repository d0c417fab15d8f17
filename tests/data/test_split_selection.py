"""What a split expression selected, recorded by a run and checked when it is evaluated or resumed:
a slice of a folder that has gained an image is re-drawn (most of its images were trained on), and
vitflow says so instead of scoring it silently."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np

from helpers import encode, make_folder
from vitflow import checkpoint as ckpt
from vitflow.config import build_config
from vitflow.data import open_split
from vitflow.data.sources.splits import changed_selections, selection_record
from vitflow.infer.evaluate import evaluate_checkpoint
from vitflow.training import Trainer

SPLITS = ("data.train_split=train[:75%]", "data.test_split=train[75%:]")


def _add_image(folder, name="extra.png"):
    (folder / "train" / "a" / name).write_bytes(encode(np.full((8, 8, 3), 40, np.uint8)))


def _record(folder, expr):
    return selection_record(open_split(folder, expr, "folder"), expr)


def test_the_record_follows_the_images_not_where_the_folder_is(tmp_path):
    data = make_folder(tmp_path / "data", per_class=10, split="train")
    first = _record(data, "train[75%:]")
    assert first["split"] == "train[75%:]" and first["images"] == 8 and len(first["digest"]) == 16
    moved = shutil.copytree(data, tmp_path / "elsewhere")  # the same images under another root
    assert _record(moved, "train[75%:]") == first
    assert changed_selections({"test": first}, {"test": _record(moved, "train[75%:]")}, moved) == []
    (moved / "train" / "b" / "003.png").rename(moved / "train" / "b" / "zzz.png")  # as many images, one renamed
    renamed = _record(moved, "train")
    assert renamed["images"] == 30 and renamed["digest"] != _record(data, "train")["digest"]
    [line] = changed_selections({"train": _record(data, "train")}, {"train": renamed}, moved)
    assert "as many, 30" in line and "not comparable" in line and "re-drawn" not in line


def test_one_image_added_re_draws_a_slice_and_the_line_says_what_that_means(tmp_path):
    data = make_folder(tmp_path / "data", per_class=20, split="train")
    before_train = set(open_split(data, "train[:75%]", "folder").keys.tolist())
    before = {"train": _record(data, "train[:75%]"), "test": _record(data, "train[75%:]")}
    _add_image(data)
    after = open_split(data, "train[75%:]", "folder")
    trained_on = np.mean([k in before_train for k in after.keys.tolist()])
    assert trained_on > 0.5  # the message's claim: most of the new held-out slice was trained on
    [line] = changed_selections(before, {"test": selection_record(after, "train[75%:]")}, data)
    assert line.startswith(f"data.test_split='train[75%:]' of {data} now selects other images (as many, 15,")
    assert "re-drawn" in line and "were trained on" in line
    # an expression the run never used is nobody's business: no line
    assert changed_selections(before, {"test": _record(data, "train[:10%]")}, data) == []


def _folder_config(run, data, steps, *extra):
    return build_config(overrides=[f"train.run_dir={run}", f"data.path={data}", "data.source=folder", *SPLITS,
                                   "model.img_size=8", "train.batch_size=8", f"train.total_steps={steps}",
                                   "train.live_report=false", "train.tensorboard=false", *extra])


def test_a_run_records_its_selections_and_eval_and_resume_warn_when_the_data_changed(tmp_path, caplog):
    data, run = make_folder(tmp_path / "data", per_class=12, split="train"), tmp_path / "run"
    Trainer(_folder_config(run, data, 2)).fit()
    state = ckpt.load_checkpoint(run)
    assert state["splits"]["train"] == _record(data, "train[:75%]")  # 27 of the 36 images
    assert state["splits"]["test"] == _record(data, "train[75%:]") and state["splits"]["train"]["images"] == 27
    counts = json.loads((run / "class_counts.json").read_text())["splits"]
    assert counts["train"]["split"] == "train[:75%]" and counts["train"]["digest"] == state["splits"]["train"]["digest"]
    assert sum(counts["test"]["counts"]) == counts["test"]["images"] == 9
    with caplog.at_level(logging.WARNING):
        evaluate_checkpoint(ckpt.latest_checkpoint(run))
    assert "now selects" not in caplog.text  # the data as it was: nothing to say
    _add_image(data)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        result = evaluate_checkpoint(ckpt.latest_checkpoint(run))
    [line] = [r.getMessage() for r in caplog.records if "now selects" in r.getMessage()]
    assert "data.test_split='train[75%:]'" in line and "(as many, 9," in line and "re-drawn" in line
    assert result["test_top1"] is not None  # scored all the same: the warning says what it is worth
    caplog.clear()
    other = shutil.copytree(data, tmp_path / "other")
    with caplog.at_level(logging.WARNING):
        evaluate_checkpoint(ckpt.latest_checkpoint(run), [f"data.path={other}"])
    assert "now selects" not in caplog.text  # other data named on purpose: not the run's, nothing compared
    cfg = _folder_config(run, data, 3, "train.resume=auto")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Trainer(cfg).fit()
    lines = [r.getMessage() for r in caplog.records if "now selects" in r.getMessage()]
    assert len(lines) == 2 and all(line.startswith("the resumed run's data.") for line in lines)
    [train] = [line for line in lines if "data.train_split='train[:75%]'" in line]
    assert "28 images, not the 27" in train and "re-drawn" in train
