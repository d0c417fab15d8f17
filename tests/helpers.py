"""Helpers shared by the tests: small real-looking image folders and tars generated per test, the
paths of the project's shared real data, and the digits training config most tests start from."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# the project's real data: ../shared/data beside the checkout, or wherever VITFLOW_SHARED_DATA points
SHARED_DATA = Path(os.environ.get("VITFLOW_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
CIFAR_TAR = SHARED_DATA / "cifar10-jpg.tar"
IMAGENET_TAR = SHARED_DATA / "imagenet-sample-1000.tar"


def encode(array: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kw)
    return buf.getvalue()


def make_folder(root: Path, classes=("a", "b", "c"), per_class: int = 8, size: int = 8, split: str | None = None,
                seed: int = 0) -> Path:
    """``root/[split/]<class>/<i>.png``: each class a distinct mean colour plus noise, so a model can
    learn it."""
    rng = np.random.default_rng(seed)
    base = root / split if split else root
    for ci, c in enumerate(classes):
        (base / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = np.clip(rng.normal(40 + 80 * ci, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            (base / c / f"{i:03d}.png").write_bytes(encode(arr))
    return root


def tar_folder(folder: Path, tar_path: Path, arcname: str | None = None) -> Path:
    with tarfile.open(tar_path, "w") as tf:
        tf.add(folder, arcname=arcname or folder.name)
    return tar_path


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data not found: {path}")
    return path


ROOT = Path(__file__).resolve().parents[1]  # the checkout
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}  # for `python -m vitflow` children


def digits_config(run_dir, *extra):
    """The default preset (a small ViT on the embedded digits) writing to ``run_dir``, logging every
    5 steps, with ``extra`` ``key=value`` overrides."""
    from vitflow.config import build_config

    return build_config(overrides=[f"train.run_dir={run_dir}", "train.log_every=5", *extra])


MEASURED = {"time", "images_per_s", "data_stall", "memory_mb", "elapsed_s", "train_images_per_s", "run_dir",
            "checkpoint", "samples"}


def comparable_records(run_dir) -> list[dict]:
    """A run's ``train`` / ``eval`` / ``epoch`` / ``summary`` records without the measured fields
    (times, throughputs, memory, paths): what an interrupted and resumed run must reproduce."""
    from vitflow.rundir import read_metrics

    return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(run_dir)
            if r["kind"] in ("train", "eval", "epoch", "summary")]


def snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes: to show a folder was left exactly as it was."""
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}
