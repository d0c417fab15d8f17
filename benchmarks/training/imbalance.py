"""Imbalanced classes on real pixels: a CIFAR-10 subset with a 10:1 imbalance, trained three ways —
plain, ``train.class_weights=balanced`` and ``data.sampler=balanced`` — each scored by balanced
accuracy (the mean of the per-class recalls) on a balanced test subset.

    python benchmarks/training/imbalance.py [--classes cat,dog,truck] [--train-counts 500,50,500]
        [--test-per-class 200] [--steps 600] [--data CIFAR_TAR] [--out DIR] [--json] [key=value ...]

The subset is cut from the shared CIFAR-10 JPEG tar (the first images of each class folder, train
and test) into ``DIR/data/{train,test}/<class>/``; every run shares its seed, steps and recipe (the
cifar10-vit-tiny preset with a smaller model, ``RECIPE``), only the imbalance handling differs.
Smoke run: ``--train-counts 20,2,20 --test-per-class 5 --steps 4``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

DEFAULT_DATA = Path(os.environ.get("VITFLOW_SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data"
                    ) / "cifar10-jpg.tar"
RECIPE = ["model.depth=4", "model.embed_dim=128", "model.num_heads=4", "train.batch_size=64", "optim.lr=1e-3",
          "optim.warmup_steps=50", "train.label_smoothing=0", "train.eval_every=0", "train.checkpoint_every=0",
          "data.val_split=none"]
MODES = {"plain": [], "class_weights": ["train.class_weights=balanced"], "sampler": ["data.sampler=balanced"]}


def build_subset(tar_path: str | Path, out: Path, classes: list[str], train_counts: list[int],
                 test_per_class: int) -> Path:
    """Write ``out/{train,test}/<class>/NNNN.jpg``: the first ``train_counts[i]`` training images of
    ``classes[i]`` and ``test_per_class`` test images of each (a balanced test set). Returns ``out``.
    Raises ValueError when the tar has too few images of a class."""
    want = {("train", c): n for c, n in zip(classes, train_counts)}
    want.update({("test", c): test_per_class for c in classes})
    got = {k: 0 for k in want}
    with tarfile.open(tar_path) as tf:
        for m in tf:
            parts = m.name.split("/")
            key = tuple(parts[-3:-1])
            if m.isfile() and key in want and got[key] < want[key]:
                dst = out / key[0] / key[1] / parts[-1]
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(tf.extractfile(m).read())
                got[key] += 1
                if got == want:
                    break
    short = {f"{s}/{c}": f"{got[(s, c)]} of {n}" for (s, c), n in want.items() if got[(s, c)] < n}
    if short:
        raise ValueError(f"{tar_path}: too few images: {short}")
    return out


def balanced_accuracy(confusion: list[list[int]]) -> float:
    """Mean over the classes with images of ``confusion[c][c] / sum(confusion[c])`` (rows: true class)."""
    recalls = [row[i] / sum(row) for i, row in enumerate(confusion) if sum(row)]
    return sum(recalls) / len(recalls)


def run_mode(mode: str, data: Path, run_dir: Path, steps: int, extra: list[str] = ()) -> dict:
    """Train one way (``MODES``) and score it: ``{"mode", "top1", "balanced_accuracy",
    "per_class_recall", "steps", "train_s"}``."""
    from vitflow.config import build_config
    from vitflow.training import train

    cfg = build_config("cifar10-vit-tiny", overrides=[f"data.path={data}", f"train.run_dir={run_dir}",
                                                      f"train.total_steps={steps}", *RECIPE, *MODES[mode], *extra])
    t0 = time.perf_counter()
    r = train(cfg)
    ev = json.loads((run_dir / "eval.json").read_text())
    return {"mode": mode, "top1": r["test_top1"], "balanced_accuracy": balanced_accuracy(ev["confusion"]),
            "per_class_recall": ev["per_class_top1"], "steps": r["step"], "train_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="the CIFAR-10 JPEG tar")
    ap.add_argument("--classes", default="cat,dog,truck")
    ap.add_argument("--train-counts", default="500,50,500", help="training images per class (10:1 by default)")
    ap.add_argument("--test-per-class", type=int, default=200)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--modes", default="plain,class_weights,sampler")
    ap.add_argument("--out", help="folder for the subset and the runs (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    classes, counts = args.classes.split(","), [int(n) for n in args.train_counts.split(",")]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="vitflow-imbalance-"))
    try:
        data = build_subset(args.data, out / "data", classes, counts, args.test_per_class)
        rows = [run_mode(m, data, out / f"run-{m}", args.steps, args.overrides) for m in args.modes.split(",")]
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(f"CIFAR-10 subset {dict(zip(classes, counts))} train images, {args.test_per_class} test images per class; "
          f"{args.steps} steps each")
    print(f"{'mode':14s} {'top-1':>7s} {'balanced acc':>13s}  per-class recall")
    for r in rows:
        recall = " ".join(f"{c} {v:.1%}" for c, v in zip(classes, r["per_class_recall"]))
        print(f"{r['mode']:14s} {r['top1']:7.1%} {r['balanced_accuracy']:13.1%}  {recall}  ({r['train_s']:.0f} s)")
    if args.json:
        print(json.dumps({"classes": classes, "train_counts": counts, "test_per_class": args.test_per_class,
                          "steps": args.steps, "results": rows}))


if __name__ == "__main__":
    main()
