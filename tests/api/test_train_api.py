"""vitflow.train(...) from Python: the same config as `vitflow train` trains the same weights and
figures, bit for bit; a user's own torch Dataset over the same CIFAR JPEGs, read by 2 loader worker
processes, trains what the tar trains; an unpicklable dataset with workers is refused in one line;
a pandas DataFrame is read as a label file is."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitflow
from helpers import ENV, cifar_subset, comparable_records, tar_folder
from vitflow.checkpoint import load_checkpoint
from vitflow.config import ConfigError
from vitflow.data import DataError, open_split
from vitflow.evaluation import split_results

# one run's settings, as Python values (the API) and as the command line's key=value text
SETTINGS = dict(model__img_size=32, model__patch_size=8, model__embed_dim=48, model__depth=2, model__num_heads=3,
                data__train_augment="pad_crop", data__padding=4,
                data__hflip=True, data__num_workers=2, data__max_in_memory=0, data__mean=(0.5, 0.5, 0.5),
                train__batch_size=32, train__total_steps=6, train__eval_every=3, train__precision="fp32",
                train__live_report=False, train__tensorboard=False, optim={"lr": 1e-3, "warmup_steps": 2})
CLI_SETTINGS = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=48", "model.depth=2", "model.num_heads=3",
                "data.train_augment=pad_crop", "data.padding=4",
                "data.hflip=true", "data.num_workers=2", "data.max_in_memory=0", "data.mean=[0.5,0.5,0.5]",
                "train.batch_size=32", "train.total_steps=6", "train.eval_every=3", "train.precision=fp32",
                "train.live_report=false", "train.tensorboard=false", "optim.lr=0.001", "optim.warmup_steps=2"]
PRESET, MODEL = "cifar10-vit-tiny", "vit_tiny_patch16_224"


class CifarJpegs(torch.utils.data.Dataset):
    """A user's own Dataset: the JPEGs of one split of a tar, in member-name order, decoded by PIL.
    The tar is opened in each process on first use and left out of the pickle (picklable)."""

    def __init__(self, tar_path: Path, split: str):
        self.tar_path = tar_path
        with tarfile.open(tar_path) as tf:
            self.members = sorted(m.name for m in tf.getmembers() if m.isfile() and f"/{split}/" in m.name)
        self.classes = sorted({m.split("/")[-2] for m in self.members})
        self.targets = [self.classes.index(m.split("/")[-2]) for m in self.members]
        self._tar, self._pid = None, None

    def __len__(self):
        return len(self.members)

    def __getitem__(self, i):
        if self._tar is None or self._pid != os.getpid():  # opened in each process: a forked loader worker
            self._tar, self._pid = tarfile.open(self.tar_path), os.getpid()  # must not share the parent's offset
        return Image.open(io.BytesIO(self._tar.extractfile(self.members[i]).read())), self.targets[i]

    def __getstate__(self):
        return {**self.__dict__, "_tar": None}


class OpenTar(CifarJpegs):
    """The same images with the tar opened in ``__init__`` and pickled with it: not picklable."""

    def __init__(self, tar_path: Path, split: str):
        super().__init__(tar_path, split)
        self._tar = tarfile.open(tar_path)

    def __getstate__(self):
        return self.__dict__


@pytest.fixture(scope="module")
def cifar_tar(tmp_path_factory) -> Path:
    """240 training and 60 test JPEGs of CIFAR-10 (every class), as a tar laid out as the shared one."""
    root = tmp_path_factory.mktemp("cifar")
    return tar_folder(cifar_subset(root / "cifar", n_train=240, n_test=60), root / "cifar.tar")


@pytest.fixture(scope="module")
def tar_run(cifar_tar, tmp_path_factory):
    return vitflow.train(data=cifar_tar, model=MODEL, preset=PRESET, train__run_dir=str(
        tmp_path_factory.mktemp("api") / "run"), **SETTINGS)


def weights(run) -> dict[str, torch.Tensor]:
    return load_checkpoint(run.checkpoint)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert different == []


@pytest.mark.slow
def test_api_and_command_line_train_the_same_run(tar_run, cifar_tar, tmp_path):
    cli_dir = tmp_path / "cli"
    out = subprocess.run([sys.executable, "-m", "vitflow", "train", "--json", "--preset", PRESET,
                          f"data.path={cifar_tar}", f"model.name={MODEL}", f"train.run_dir={cli_dir}", *CLI_SETTINGS],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cli = json.loads(out.stdout.strip().splitlines()[-1])
    assert tar_run.step == cli["step"] == 6
    assert_same_weights(weights(tar_run), load_checkpoint(cli["checkpoint"])["model"])
    assert tar_run.figures == split_results(cli)  # every figure of the final evaluation, equal
    assert vitflow.Run(cli_dir).figures == vitflow.Run(tar_run.folder).figures  # (as written: 6 decimals)
    assert 0.0 <= tar_run.figures["test"]["top1"] <= 1.0 and tar_run.figures["test"]["loss"] > 0
    assert comparable_records(tar_run.folder) == comparable_records(cli_dir)
    ours, theirs = tar_run.config, vitflow.Run(cli_dir).config
    assert {**ours["train"], "run_dir": None} == {**theirs["train"], "run_dir": None}
    assert {k: v for k, v in ours.items() if k != "train"} == {k: v for k, v in theirs.items() if k != "train"}


def test_a_user_dataset_with_two_workers_trains_what_the_tar_trains(tar_run, cifar_tar, tmp_path):
    train, test = CifarJpegs(cifar_tar, "train"), CifarJpegs(cifar_tar, "test")
    tar_source = open_split(cifar_tar, "train")
    assert [tar_source.name(i).split(":", 1)[1] for i in range(len(tar_source))] == train.members  # same order
    pil = torch.from_numpy(np.array(train[5][0])).permute(2, 0, 1)
    assert torch.equal(pil, tar_source.load(5))  # PIL's pixels are vitflow's decoder's
    run = vitflow.train(data=train, test=test, model=MODEL, preset=PRESET, train__run_dir=str(tmp_path / "ds"),
                        **SETTINGS)
    assert run.config["data"]["num_workers"] == 2 and run.config["data"]["path"].startswith("python:")
    assert_same_weights(weights(run), weights(tar_run))
    assert run.figures == tar_run.figures
    again = run.evaluate(data=test)  # vitflow eval on Python data: the final evaluation's figures
    assert (again["top1"], again["images"]) == (run.figures["test"]["top1"], 60)
    assert abs(again["loss"] - run.figures["test"]["loss"]) < 1e-6
    assert comparable_records(run.folder) == comparable_records(tar_run.folder)


def test_an_unpicklable_dataset_with_workers_is_one_clear_line(cifar_tar, tmp_path):
    with pytest.raises(DataError) as e:
        vitflow.train(data=OpenTar(cifar_tar, "train"), test=OpenTar(cifar_tar, "test"), model=MODEL, preset=PRESET,
                      train__run_dir=str(tmp_path / "bad"), **SETTINGS)
    message = str(e.value)
    assert "\n" not in message and message.startswith("OpenTar cannot go to loader worker processes")
    assert "data.num_workers=0" in message and "pickle" in message


def test_a_dataframe_reads_as_a_label_file(cifar_tar, tmp_path):
    pd = pytest.importorskip("pandas")
    folder = cifar_tar.parent / "cifar"  # the tar's images as files
    files = sorted(folder.rglob("*.jpg"))
    frame = pd.DataFrame({"path": [str(f.relative_to(folder)) for f in files][::-1],  # row order does not matter
                          "label": [f.parent.name for f in files][::-1], "split": [f.parts[-3] for f in files][::-1]})
    cfg = vitflow.Config(data=frame, preset=PRESET, data__root=str(folder))
    from_frame = open_split(cfg.data.path, "test", cfg=cfg.data)
    from_folder = open_split(folder, "test")
    assert from_frame.classes == from_folder.classes and len(from_frame) == 60
    assert np.array_equal(from_frame.labels, from_folder.labels)
    assert all(torch.equal(from_frame.load(i), from_folder.load(i)) for i in range(len(from_frame)))


def test_config_errors_name_the_key_like_the_command_line():
    with pytest.raises(ConfigError, match=r"unknown key 'train.total_stepz'; did you mean 'train.total_steps'\? "
                                          r"\(in the arguments\)"):
        vitflow.Config(train__total_stepz=3)
    with pytest.raises(ConfigError, match=r"train.batch_size='many' is invalid: expected int"):
        vitflow.train(train__batch_size="many")
    cfg = vitflow.Config(preset=PRESET, train__total_steps=7, optim={"lr": 5e-4})
    assert isinstance(cfg, vitflow.config.Config) and (cfg.train.total_steps, cfg.optim.lr) == (7, 5e-4)
    assert cfg.train.batch_size == 256  # the preset's


def test_a_config_edited_as_attributes_trains_and_is_checked_again(tmp_path):
    cfg = vitflow.Config(train__total_steps=8, train__eval_every=0, train__live_report=False,
                         train__run_dir=str(tmp_path / "run"))
    cfg.train.total_steps, cfg.optim.warmup_steps = 3, 1
    run = vitflow.train(cfg)
    assert run.step == 3 and vitflow.Run(run.folder).config["train"]["total_steps"] == 3
    cfg.train.batch_size = 0
    with pytest.raises(ConfigError, match="train.batch_size=0 is invalid"):
        vitflow.train(config=cfg, train__run_dir=str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()


def test_an_attribute_that_is_no_key_is_refused(tmp_path):
    cfg = vitflow.Config(train__run_dir=str(tmp_path / "run"))
    cfg.train.total_stepz = 3
    with pytest.raises(ConfigError, match=r"^unknown key 'train.total_stepz'; did you mean 'train.total_steps'\? "
                                          r"\(set on the Config\)$"):
        vitflow.train(cfg)
    assert not (tmp_path / "run").exists()


class Labelled(torch.utils.data.Dataset):
    """Gray 8x8 images with the given labels."""

    def __init__(self, labels):
        self.targets = list(labels)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return Image.new("RGB", (8, 8), (i, i, i)), self.targets[i]


@pytest.mark.parametrize("labels, message", [
    ([0, 1, None], r"^Labelled\[2\]: label None \(NoneType\) is neither a class index"),
    (["a", "b", 0.5], r"^Labelled\[2\]: label 0.5 \(float\) is neither"),
    ([0, 1, -1], r"^Labelled\[2\]: label -1 \(int\) is neither"),
    ([0, "ants", 1], r"^Labelled mixes class indices and class names: Labelled\[0\] is 0, Labelled\[1\] is 'ants'"),
    (["ants"] * 3, r"^Labelled: every item has the label 'ants'; a classifier needs at least 2 classes$"),
])
def test_labels_that_would_train_a_wrong_model_are_refused(labels, message):
    from vitflow.data.sources.pyobjects import DatasetSource

    with pytest.raises(DataError, match=message):
        DatasetSource.open(Labelled(labels))
    assert DatasetSource.open(Labelled([1, 0, 1])).classes == ["0", "1"]
    assert DatasetSource.open(Labelled(["ants"] * 2), classes=["ants", "bees"]).labels.tolist() == [0, 0]  # a val split


def test_import_vitflow_loads_neither_the_api_nor_the_loop():
    out = subprocess.run([sys.executable, "-c", "import inspect, sys, vitflow; print(sorted(m for m in ('vitflow.api', "
                          "'vitflow.training', 'vitflow.data.pipeline') if m in sys.modules)); "
                          "print(inspect.isfunction(vitflow.train), vitflow.Callback is vitflow.training.Callback)"],
                         capture_output=True, text=True, env=ENV, timeout=300)
    assert out.stdout.split("\n")[:2] == ["[]", "True True"], out.stderr[-1000:]
