"""Build a folder with known faults, for measuring ``vitflow inspect`` and its peers: a copy of
real class-folder data with a fraction of the training labels flipped at random (seeded) and
held-out images planted in train as near-copies (resized, cropped to 90%, re-encoded at JPEG
quality 60). The ground truth goes beside it as ``truth.json``: ``flipped`` (training keys whose
folder is wrong, with their true class) and ``planted`` (``[train key, held-out key]`` pairs).

    python benchmarks/quality/planted.py --data ../shared/data/hymenoptera.tar --out /tmp/planted
    python benchmarks/quality/planted.py --data ../shared/data/cifar10-jpg.tar --per-class 300 300 \
        --out /tmp/planted-cifar --flip 0.1
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vitflow.data import open_split  # noqa: E402
from vitflow.data.sources.dispatch import split_names  # noqa: E402


def near_copy(data: bytes, rng: np.random.Generator) -> bytes:
    """Crop to 90% of each side (at a random place), resize by 0.6-0.9 (at least 24 px), JPEG q60."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    cw, ch = int(w * 0.9), int(h * 0.9)
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    img = img.crop((x, y, x + cw, y + ch))
    s = float(rng.uniform(0.6, 0.9))
    img = img.resize((max(24, int(cw * s)), max(24, int(ch * s))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=60)
    return buf.getvalue()


def build(data: str, out: Path, flip: float, copies: int, seed: int, per_class: tuple[int, int] | None) -> dict:
    rng = np.random.default_rng(seed)
    splits = split_names(data)
    held_name = next(s for s in ("test", "val", "valid", "validation") if s in splits)
    train = open_split(data, "train")
    held = open_split(data, held_name, classes=list(train.classes))
    if out.exists():
        shutil.rmtree(out)
    keep = {}
    for name, src, n in (("train", train, per_class and per_class[0]), (held_name, held, per_class and per_class[1])):
        idx = np.arange(len(src))
        if n:
            idx = np.concatenate([rng.permutation(np.flatnonzero(src.labels == c))[:n] for c in range(len(src.classes))])
        keep[name] = (src, np.sort(idx))
    truth = {"flipped": {}, "planted": [], "held_split": held_name, "classes": list(train.classes)}
    src, idx = keep["train"]
    flipped = set(rng.choice(idx, int(round(flip * len(idx))), replace=False).tolist())
    for i in idx:
        true = src.classes[int(src.labels[i])]
        given = true
        if i in flipped:
            given = src.classes[int(rng.choice([c for c in range(len(src.classes)) if c != src.labels[i]]))]
        key = f"train/{given}/{int(i):06d}{Path(src.name(int(i))).suffix}"  # unique whatever class it lands in
        (out / key).parent.mkdir(parents=True, exist_ok=True)
        (out / key).write_bytes(src.encoded(int(i)))
        if given != true:
            truth["flipped"][key] = true
    hsrc, hidx = keep[held_name]
    for i in hidx:
        key = f"{held_name}/{hsrc.classes[int(hsrc.labels[i])]}/{int(i):06d}{Path(hsrc.name(int(i))).suffix}"
        (out / key).parent.mkdir(parents=True, exist_ok=True)
        (out / key).write_bytes(hsrc.encoded(int(i)))
    for n, i in enumerate(rng.choice(hidx, copies, replace=False)):
        c = hsrc.classes[int(hsrc.labels[i])]
        key = f"train/{c}/planted_{n:03d}.jpg"
        (out / key).write_bytes(near_copy(hsrc.encoded(int(i)), rng))
        truth["planted"].append([key, f"{held_name}/{c}/{int(i):06d}{Path(hsrc.name(int(i))).suffix}"])
    (out.parent / f"{out.name}.truth.json").write_text(json.dumps(truth, indent=1))
    return truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="class-folder data with a train and a test / val split (tar or folder)")
    ap.add_argument("--out", required=True, type=Path, help="the new folder (replaced if it exists)")
    ap.add_argument("--flip", type=float, default=0.1, help="fraction of training labels flipped (0.1)")
    ap.add_argument("--copies", type=int, default=30, help="held-out images planted in train (30)")
    ap.add_argument("--per-class", type=int, nargs=2, metavar=("TRAIN", "HELD"), help="images per class kept")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t = build(a.data, a.out, a.flip, a.copies, a.seed, tuple(a.per_class) if a.per_class else None)
    print(f"{a.out}: {len(t['flipped'])} labels flipped, {len(t['planted'])} copies planted; truth: "
          f"{a.out.parent / (a.out.name + '.truth.json')}")


if __name__ == "__main__":
    main()
