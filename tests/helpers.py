"""Helpers shared by the tests: small real-looking image folders and tars generated per test, the
paths of the project's shared real data, and the digits training config most tests start from."""

from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

# the project's real data: ../shared/data beside the checkout, or wherever VITFLOW_SHARED_DATA points
SHARED_DATA = Path(os.environ.get("VITFLOW_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
CIFAR_TAR = SHARED_DATA / "cifar10-jpg.tar"
IMAGENET_TAR = SHARED_DATA / "imagenet-sample-1000.tar"
HYMENOPTERA_TAR = SHARED_DATA / "hymenoptera.tar"


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
    5 steps, with ``extra`` ``key=value`` overrides (the model section of the named family's class)."""
    from vitflow.config import build_config
    from vitflow.models import config_class

    return build_config(overrides=[f"train.run_dir={run_dir}", "train.log_every=5", *extra], model_config=config_class)


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


def cifar_mosaics(root: Path, counts=(("train", 1200), ("val", 300), ("test", 300)), classes=None,
                  seed: int = 0) -> Path:
    """A multi-label dataset of real pixels: 2x2 mosaics (64x64 PNG) of four CIFAR-10 images, each
    labelled with the set of its tiles' classes (``;``-separated), listed in ``root/labels.csv``
    (columns ``path``, ``labels``, ``split``). Train and val tiles come from CIFAR's train split,
    test tiles from its test split; ``classes`` restricts the tiles to those CIFAR classes."""
    from vitflow.data import open_split

    rng = np.random.default_rng(seed)
    rows = []
    for split, n in counts:
        src = open_split(need(CIFAR_TAR), "test" if split == "test" else "train")
        pool = np.flatnonzero(np.isin(np.array(src.classes)[src.labels], classes)) if classes else np.arange(len(src))
        pick = rng.choice(pool, size=(n, 4), replace=False if 4 * n <= len(pool) else True)
        (root / split).mkdir(parents=True, exist_ok=True)
        for i, tiles in enumerate(pick):
            t = [src.load(int(j)).permute(1, 2, 0).numpy() for j in tiles]
            mosaic = np.concatenate([np.concatenate(t[:2], axis=1), np.concatenate(t[2:], axis=1)], axis=0)
            rel = f"{split}/{i:05d}.png"
            (root / rel).write_bytes(encode(mosaic))
            rows.append(f"{rel},{';'.join(sorted({src.classes[int(src.labels[j])] for j in tiles}))},{split}")
    (root / "labels.csv").write_text("path,labels,split\n" + "\n".join(rows) + "\n")
    return root / "labels.csv"


def cifar_subset(root: Path, n_train: int = 120, n_test: int = 60) -> Path:
    """Real CIFAR-10 JPEGs as ``root/{train,test}/<class>/<name>.jpg`` (a slice of each split)."""
    from vitflow.data import open_split

    for split, n in (("train", n_train), ("test", n_test)):
        src = open_split(need(CIFAR_TAR), f"{split}[:{n}]")
        for i in range(len(src)):
            member = os.fsdecode(src.keys[i])  # cifar10/<split>/<class>/<file>
            path = root / member.split("/", 1)[1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(src.encoded(i))
    return root


def rows_of(folder: Path) -> list[dict]:
    """One row per image of ``folder``, in a shuffled order: path (relative), label, split."""
    rows = [{"path": p.relative_to(folder).as_posix(), "label": p.parent.name, "split": p.parts[-3]}
            for p in sorted(folder.rglob("*.jpg"))]
    order = np.random.default_rng(1).permutation(len(rows))
    return [rows[i] for i in order]


def write_csv(path: Path, rows: list[dict], delimiter: str = ",", columns=("path", "label", "split")) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), delimiter=delimiter, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of a child that a test interrupts with SIGINT (Ctrl-C): the default disposition,
    so Python raises KeyboardInterrupt as in a terminal. A shell's background job (``pytest ... &``
    in a script) starts with SIGINT ignored, every child inherits that, and a SIGINT that lands
    before vitflow installs its own handler would be ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_at_first_checkpoint(cmd: list[str], run_dir: Path, env: dict) -> list[Path]:
    """Start ``cmd`` (a ``vitflow train`` writing to ``run_dir``), SIGKILL it as soon as its first
    checkpoint appears (or after 120 s), check it died of the signal, and return the checkpoints
    it left (newest last)."""
    from vitflow import checkpoint as ckpt

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not ckpt.list_checkpoints(run_dir) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    return ckpt.list_checkpoints(run_dir)


class RecordedOps(TorchDispatchMode):
    """Records the names of the ops (``addmm``, ``_linear_pointwise``, ...) that run inside it, in ``ops``."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket).split(".")[-1])
        return func(*args, **(kwargs or {}))


def output_and_grads(model, x):
    """``model(x)`` weighted by class index, backpropagated: ``(output, input gradient, {name:
    parameter gradient})``, the gradients cleared from the model afterwards."""
    import torch

    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.arange(out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), x.grad, grads


def check_checkpoint_plans(model, x, spec):
    """A hierarchical model's checkpointing plans give bit-identical gradients: ``all`` and the
    block list ``spec`` against none; an index past the blocks is refused; ``auto`` with a 1 KiB
    budget checkpoints every block, with 1 GiB none. Returns the per-block flags ``spec`` set."""
    import pytest
    import torch

    plain = output_and_grads(model, x)
    flags = []
    for s in ("all", spec):
        model.set_grad_checkpointing(s)
        got = output_and_grads(model, x)
        assert torch.equal(got[1], plain[1])
        assert all(torch.equal(g, plain[2][n]) for n, g in got[2].items())
        flags = [b.grad_checkpointing for b in model.blocks]
    with pytest.raises(ValueError, match="out of range"):
        model.set_grad_checkpointing(str(len(model.blocks)))
    for budget, every in (("1KiB", True), ("1GiB", False)):
        model.set_grad_checkpointing("auto", budget)
        output_and_grads(model, x)
        assert all(b.grad_checkpointing == every for b in model.blocks), budget
    return flags


def take_pretrained(cfg):
    """``cfg`` filled from ``model.pretrained`` as the trainer fills it (architecture for
    ``model.name=auto``, the weights' preprocessing); returns the resolved weights."""
    from vitflow.models.pretrained.config import apply_pretrained

    cfg.model, pre = apply_pretrained(cfg.model, cfg.data, getattr(cfg, "key_origins", None))
    return pre


# ImageNet-1k class indices (the sample's files sorted by WordNet id) of photos of each CIFAR-10 class
IMAGENET_AS_CIFAR = {
    "airplane": (404, 895), "automobile": (436, 468, 511, 609, 627, 656, 661, 751, 817),
    "bird": (*range(7, 25), *range(80, 101), *range(127, 147)), "cat": tuple(range(281, 286)),
    "deer": (351, 352, 353), "dog": tuple(range(151, 269)), "frog": (30, 31, 32), "horse": (339,),
    "ship": (403, 484, 510, 554, 625, 628, 724, 780, 814, 871, 914), "truck": (555, 569, 675, 717, 734, 864, 867),
}


def photo_folder(root: Path, cifar=(("train", 300), ("val", 50), ("test", 50)), imagenet=(0.6, 0.2, 0.2)) -> Path:
    """A photo folder of real photos in the 10 CIFAR-10 classes, ``root/{train,val,test}/<class>/``:
    CIFAR-10 JPEGs (32x32, ``cifar`` gives the count per class of each split, taken in order from
    CIFAR's train split, none twice) and the ImageNet sample's photos of those classes
    (:data:`IMAGENET_AS_CIFAR`: 218 photos of many sizes, up to 2400 px; split by the fractions
    ``imagenet`` within each class). The defaults give 4,218 images (3,131 / 544 / 543)."""
    from vitflow.data import open_split

    src = open_split(need(CIFAR_TAR), "train")
    for c, name in enumerate(src.classes):
        rows = np.flatnonzero(src.labels == c)
        start = 0
        for split, n in cifar:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in rows[start:start + n]:
                (root / split / name / f"c{int(i):05d}.jpg").write_bytes(src.encoded(int(i)))
            start += n
    with tarfile.open(need(IMAGENET_TAR)) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name)
        for name, indices in IMAGENET_AS_CIFAR.items():
            cuts = np.cumsum([round(f * len(indices)) for f in imagenet[:-1]])
            for part, split in zip(np.split(np.array(indices), cuts), [s for s, _ in cifar]):
                for i in part:
                    m = members[int(i)]
                    (root / split / name / Path(m.name).name).write_bytes(tf.extractfile(m).read())
    return root
def stage_attention_figures(checkpoint, tmp_path, layer):
    """``vitflow attention`` of a hierarchical model's checkpoint on a random 8x8 image: the
    figure's info for the last block and for block ``layer`` (PNGs written under ``tmp_path``)."""
    import numpy as np
    from PIL import Image

    from vitflow.viz.attention import attention_figure

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    last = attention_figure(checkpoint, tmp_path / "a.png", tmp_path / "last.png")
    first = attention_figure(checkpoint, tmp_path / "a.png", tmp_path / "first.png", layer=layer)
    assert (tmp_path / "first.png").stat().st_size > 0 and (tmp_path / "last.png").stat().st_size > 0
    return last, first


def check_run_checkpoint(trainer, summary, name, key):
    """A short run's checkpoint names model ``name`` and holds state key ``key``; the model rebuilt
    from it computes the trainer's logits on two 16-px images; the test top-1 is a fraction."""
    import torch

    from vitflow import checkpoint as ckpt

    state = ckpt.load_checkpoint(summary["checkpoint"])
    assert state["model_args"]["name"] == name and key in state["model"]
    model = ckpt.model_from_checkpoint(state).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), trainer.model.eval()(x))
    assert 0.0 <= summary["test_top1"] <= 1.0


def hymenoptera_subset(root: Path, counts=(("train", 12), ("val", 6))) -> Path:
    """Real hymenoptera photos as ``root/<split>/<class>/<name>.jpg``: the first ``n`` of each class of each split."""
    from vitflow.data import open_split

    for split, n in counts:
        src = open_split(need(HYMENOPTERA_TAR), split)
        for c, name in enumerate(src.classes):
            for i in np.flatnonzero(src.labels == c)[:n]:
                p = root / split / name / src.name(int(i)).rsplit("/", 1)[-1]
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(src.encoded(int(i)))
    return root
