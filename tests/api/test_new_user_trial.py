"""What a new user's trial of the Python API stumbled on: a TTA typo is one line with the nearest
spec; a user Dataset whose ``__getitem__`` raises stops with one line naming its class, the index
and the error (the original as ``__cause__``), in this process and in loader worker processes; and
``data.num_workers`` is the number of processes that read a user's Dataset into the RAM cache
(0: this process), said in one log line, without changing the figures."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

import vitflow
from helpers import cifar_subset
from vitflow.checkpoint import load_checkpoint
from vitflow.data import DataError, open_datasets
from vitflow.data.sources.pyobjects import DatasetItemError

SMALL = dict(model="vit_tiny_patch16_224", preset="cifar10-vit-tiny", model__img_size=32, model__patch_size=8,
             model__embed_dim=48, model__depth=2, model__num_heads=3, data__train_augment="pad_crop",
             data__test_split="none", train__batch_size=16, train__total_steps=3, train__eval_every=0,
             train__precision="fp32", train__live_report=False, train__tensorboard=False, optim={"warmup_steps": 1})


class Photos(torch.utils.data.Dataset):
    """Real CIFAR-10 JPEGs of one split folder: (PIL image, class name). Items in ``bad`` raise
    KeyError; with ``log`` set, each read appends the reading process's id to that file."""

    def __init__(self, folder: Path, bad: tuple[int, ...] = (), log: Path | None = None):
        self.files, self.bad, self.log = sorted(folder.rglob("*.jpg")), set(bad), log
        self.targets = [f.parent.name for f in self.files]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        if self.log is not None:
            with open(self.log, "a") as f:  # one short line per read: O_APPEND keeps lines whole
                f.write(f"{os.getpid()}\n")
        if i in self.bad:
            raise KeyError(f"no photo {i}")
        return Image.open(self.files[i]).convert("RGB"), self.targets[i]


class Unpicklable(Photos):
    """The same photos with a lock (which does not pickle) held from ``__init__``."""

    def __init__(self, folder: Path, **kw):
        super().__init__(folder, **kw)
        import threading

        self.lock = threading.Lock()


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    """64 training and 16 test JPEGs of CIFAR-10 as class folders."""
    return cifar_subset(tmp_path_factory.mktemp("cifar"), n_train=64, n_test=16)


@pytest.fixture(scope="module")
def run(cifar, tmp_path_factory):
    return vitflow.train(data=Photos(cifar / "train"), val=Photos(cifar / "test"), data__num_workers=0,
                         train__run_dir=str(tmp_path_factory.mktemp("run") / "r"), **SMALL)


CHOICES = "expected flip, crops5, scales=S1,S2,... (numbers > 0, last) or none, comma-separated"


@pytest.mark.parametrize("tta, hint", [("flp", "; did you mean 'flip'?"), ("flip,crop5", "; did you mean 'flip,crops5'?"),
                                       ("scale=0.9,1", "; did you mean 'scales=0.9,1'?"), ("xyz", "")])
def test_a_tta_typo_is_one_line_with_the_choices_and_the_nearest_spec(run, tta, hint):
    part = tta.split(",")[-1] if tta != "scale=0.9,1" else "scale=0.9"
    expected = f"tta={tta!r}: cannot read {part!r}: {CHOICES}{hint}"
    for call in (lambda: vitflow.load(run, tta=tta), lambda: run.evaluate(tta=tta), lambda: run.predict([], tta=tta),
                 lambda: run.export(run.folder / "m.onnx", tta=tta)):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == expected
    assert not (run.folder / "m.onnx").exists()  # refused before any work
    with pytest.raises(ValueError, match=r"^tta=True is not a TTA spec: give text such as 'flip'"):
        vitflow.load(run, tta=True)
    with pytest.raises(ValueError, match=r"^tta='flip,flip': 'flip' is there twice; give each part once$"):
        vitflow.load(run, tta="flip,flip")
    assert vitflow.load(run, tta="flip").predictor.tta == "flip"  # a valid spec still loads


@pytest.mark.parametrize("fmt, tta, expected", [
    ("torchscript", "flip", "tta='flip' goes with format='onnx' (its metadata records the views), not "
                            "format='torchscript': that export holds the plain model"),
    ("hub", "flip", "tta='flip' goes with format='onnx' (its metadata records the views), not format='hub': "
                    "that export holds the plain model"),
    ("onnx", "scales=0.9,1", "tta='scales=0.9,1': an export has one input size; use flip and/or crops5")])
def test_an_export_that_cannot_hold_the_views_says_so_in_python_terms(run, tmp_path, fmt, tta, expected):
    with pytest.raises(ValueError) as e:
        run.export(tmp_path / "m", format=fmt, tta=tta)
    assert str(e.value) == expected
    assert not list(tmp_path.iterdir())  # refused before any work


def test_export_tta_on_the_command_line_names_the_flags():
    from vitflow.infer.tta import check_export_tta

    with pytest.raises(ValueError, match=r"^--tta flip goes with --format onnx \(its metadata records the views\), "
                                         r"not --format triton: that export holds the plain model$"):
        check_export_tta("flip", "triton")
    assert str(check_export_tta("flip,crops5", "onnx")) == "flip,crops5"
    assert not check_export_tta(None, "hub").enabled  # no views: every format


def test_a_raising_getitem_is_one_line_in_this_process(cifar, tmp_path):
    with pytest.raises(DatasetItemError) as e:  # the RAM cache's probe reads the first 32 items here
        vitflow.train(data=Photos(cifar / "train", bad=(3,)), val=Photos(cifar / "test"), data__num_workers=0,
                      train__run_dir=str(tmp_path / "r"), **SMALL)
    assert str(e.value) == "Photos[3]: __getitem__ raised KeyError: 'no photo 3'"
    assert isinstance(e.value.__cause__, KeyError) and e.value.__cause__.args == ("no photo 3",)
    assert isinstance(e.value, DataError)  # caught as every other data error is


@pytest.mark.parametrize("in_ram", [True, False], ids=["cache-readers", "loader-workers"])
def test_a_raising_getitem_is_one_line_from_worker_processes(cifar, tmp_path, in_ram):
    # in RAM: items 0-31 are probed here, item 40 is read by a forked reader; else by DataLoader workers
    bad = (40,) if in_ram else tuple(range(2, 64))
    with pytest.raises(DatasetItemError) as e:
        vitflow.train(data=Photos(cifar / "train", bad=bad), val=Photos(cifar / "test"), data__num_workers=2,
                      data__max_in_memory=200_000 if in_ram else 0, train__run_dir=str(tmp_path / "r"), **SMALL)
    message = str(e.value)
    found = re.fullmatch(r"Photos\[(\d+)\]: __getitem__ raised KeyError: 'no photo (\d+)'", message)
    assert found and found[1] == found[2] and int(found[1]) in bad, message
    cause = str(e.value.__cause__)  # the worker's traceback text, the original error in it
    assert f"KeyError: 'no photo {found[1]}'" in cause and "in __getitem__" in cause


def read_pids(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()]


@pytest.mark.parametrize("workers", [0, 2, "auto"])
def test_num_workers_is_the_processes_that_read_a_dataset_into_ram(cifar, tmp_path, caplog, workers):
    log = tmp_path / "pids"
    cfg = vitflow.Config(data=Photos(cifar / "train", log=log), val=Photos(cifar / "test"), data__num_workers=workers,
                         **{k: v for k, v in SMALL.items() if k.startswith(("data__", "model__", "preset"))})
    with caplog.at_level(logging.INFO, "vitflow"):
        data = open_datasets(cfg.data, 32)
    assert len(data.train) == 64 and data.train.fixed_size == (32, 32)  # in RAM: the batched gather
    pids = read_pids(log)
    others = set(pids) - {os.getpid()}
    readers = {0: 0, 2: 2, "auto": os.cpu_count()}[workers]
    if readers <= 1:
        assert others == set() and len(pids) == 32 + 64  # the size probe, then every item once, here
        how = "in this process"
    else:
        assert 1 <= len(others) <= readers and sum(p in others for p in pids) == 64
        how = f"in {readers} worker processes"
    lines = [r.getMessage() for r in caplog.records if "into RAM once" in r.getMessage()]
    assert lines[0] == (f"Photos: reading its 64 items into RAM once, {how} (data.num_workers={workers}); the epochs "
                        "then take their batches from RAM (data.max_in_memory=0 reads the dataset every epoch)")


def test_the_reader_count_changes_no_weight(run, cifar, tmp_path):
    two = vitflow.train(data=Photos(cifar / "train"), val=Photos(cifar / "test"), data__num_workers=2,
                        train__run_dir=str(tmp_path / "two"), **SMALL)
    a, b = load_checkpoint(run.checkpoint)["model"], load_checkpoint(two.checkpoint)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert two.figures == run.figures and 0.0 <= run.figures["val"]["top1"] <= 1.0


def test_a_dataset_that_does_not_pickle_is_read_here_or_refused(cifar, caplog):
    kept = {k: v for k, v in SMALL.items() if k.startswith(("data__", "model__", "preset"))}
    cfg = vitflow.Config(data=Unpicklable(cifar / "train"), val=Photos(cifar / "test"), data__num_workers="auto", **kept)
    with caplog.at_level(logging.INFO, "vitflow"):
        assert len(open_datasets(cfg.data, 32).train) == 64  # auto: no forked reader shares its state
    assert any("into RAM once, in this process (data.num_workers=auto)" in r.getMessage() for r in caplog.records)
    cfg = vitflow.Config(data=Unpicklable(cifar / "train"), val=Photos(cifar / "test"), data__num_workers=2, **kept)
    with pytest.raises(DataError, match=r"^Unpicklable cannot go to loader worker processes: it does not pickle "
                                        r"\(cannot pickle '_thread.lock' object\); set data.num_workers=0"):
        open_datasets(cfg.data, 32)
