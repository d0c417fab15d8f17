"""``vitflow inspect`` against the peers on a folder with known faults (``planted.py``), at the same
time budget: label-issue precision and recall among the top N flagged (N = the labels flipped), and
copy recall and precision against the planted pairs.

Peers:
- labels: cleanlab's ``find_label_issues`` (ranked by self-confidence) on out-of-fold probabilities
  from a plain k-fold training loop: torchvision's ResNet-18 from scratch, SGD with momentum and a
  cosine schedule over the fold's seconds, random crop + flip, images decoded once up front;
- copies: imagededup's ``PHash`` (its default ``max_distance_threshold=10``), pairs across splits
  as leaks; imagededup's ``CNN`` needs MobileNetV3 weights from the internet, so it is reported
  as unavailable where there is none.

    python benchmarks/quality/planted.py --data ../shared/data/cifar10-jpg.tar --per-class 300 100 --out /tmp/pl_c
    python benchmarks/quality/peers.py --data /tmp/pl_c --budget 5m [--model RUN]

One JSON line per method; ``pip install imagededup`` for the copy peers.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vitflow.config import DataConfig, parse_duration  # noqa: E402
from vitflow.data.fixes import image_key  # noqa: E402
from vitflow.data.transforms import Preprocess, eval_transform  # noqa: E402
from vitflow.quality.inspection import open_splits  # noqa: E402


def flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in ("amx_tile", "avx512_bf16", "avx2") if f in text})) or "none"


def label_scores(flagged: list[str], truth: dict) -> dict:
    flipped = set(truth["flipped"])
    top = flagged[:len(flipped)]
    hit = len(set(top) & flipped)
    return {"label_precision_at_n": round(hit / max(1, len(top)), 3), "label_recall_at_n": round(hit / len(flipped), 3),
            "labels_flagged": len(flagged), "label_recall_all": round(len(set(flagged) & flipped) / len(flipped), 3)}


def copy_scores(pairs: set[tuple[str, str]], truth: dict) -> dict:
    planted = {tuple(p) for p in truth["planted"]}
    hit = len(pairs & planted)
    return {"copy_recall": round(hit / len(planted), 3), "copy_precision": round(hit / max(1, len(pairs)), 3),
            "leaks_flagged": len(pairs)}


def ours(data: Path, truth: dict, budget: str, model: str | None) -> dict:
    import vitflow

    out = Path(f"/tmp/peers-inspect-{data.name}-{'model' if model else 'kfold'}")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    df = vitflow.inspect(str(data), model=model, time_budget=budget, out=out)
    seconds = time.perf_counter() - t0
    li = df[(df.finding == "label_issue") & (df.split == "train")]
    leaks = {(r.key, r.other_key) for r in df[df.finding == "leak"].itertuples()}
    return {"method": f"vitflow inspect ({'--model' if model else 'k-fold'})", "seconds": round(seconds, 1),
            **label_scores(list(li.key), truth), **copy_scores(leaks, truth)}


def _decoded(src, size: int) -> tuple[torch.Tensor, np.ndarray]:
    t = eval_transform(Preprocess(size, crop_pct=1.0))
    return torch.stack([t(src.load(i)) for i in range(len(src))]), np.asarray(src.labels)


def _resnet(num_classes: int) -> torch.nn.Module:
    from torchvision.models import resnet18

    m = resnet18(num_classes=num_classes)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)  # the small-image stem of CIFAR scripts
    m.maxpool = torch.nn.Identity()
    return m


def _fit(x: torch.Tensor, y: np.ndarray, num_classes: int, seconds: float, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model, yt = _resnet(num_classes), torch.from_numpy(y).long()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    t0, step = time.perf_counter(), 0
    model.train()
    while (frac := (time.perf_counter() - t0) / seconds) < 1:
        idx = torch.randint(len(x), (64,))
        b = x[idx].float() / 255
        pad = F.pad(b, (4, 4, 4, 4), mode="reflect")
        i, j = np.random.randint(0, 9, 2)
        b = pad[..., i:i + x.shape[-2], j:j + x.shape[-1]]
        b = torch.where(torch.rand(len(b), 1, 1, 1) < 0.5, b.flip(-1), b)
        for g in opt.param_groups:
            g["lr"] = 0.05 * 0.5 * (1 + math.cos(math.pi * frac))
        loss = F.cross_entropy(model((b - mean) / std), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    model.eval()
    return model


@torch.no_grad()
def _probs(model, x: torch.Tensor) -> np.ndarray:
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return torch.cat([model((x[s:s + 256].float() / 255 - mean) / std).softmax(-1) for s in range(0, len(x), 256)]).numpy()


def peer_labels(data: Path, truth: dict, budget_s: float, folds: int, size: int) -> dict:
    from cleanlab.filter import find_label_issues

    t0 = time.perf_counter()
    train = open_splits(DataConfig(path=str(data)))[0][1]
    keys = [image_key(train, i) for i in range(len(train))]
    x, y = _decoded(train, size)
    fold = np.random.default_rng(0).permutation(len(y)) % folds
    oof = np.zeros((len(y), len(train.classes)), np.float32)
    for f in range(folds):
        left = max(10.0, 0.9 * budget_s - (time.perf_counter() - t0)) / (folds - f)
        m = _fit(x[torch.from_numpy(fold != f)], y[fold != f], len(train.classes), left, f)
        oof[fold == f] = _probs(m, x[torch.from_numpy(fold == f)])
    rows = find_label_issues(y, oof, return_indices_ranked_by="self_confidence")
    return {"method": f"plain {folds}-fold ResNet-18 + cleanlab", "seconds": round(time.perf_counter() - t0, 1),
            "image_size": size, **label_scores([keys[i] for i in rows], truth)}


def peer_copies(data: Path, truth: dict, method: str) -> dict:
    try:
        from imagededup import methods
    except ImportError:
        return {"method": f"imagededup {method}", "unavailable": "pip install imagededup"}
    t0 = time.perf_counter()
    try:
        hasher = getattr(methods, method)()
        enc = hasher.encode_images(image_dir=str(data), recursive=True)
        dup = hasher.find_duplicates(encoding_map=enc, **({"max_distance_threshold": 10} if method == "PHash" else {}))
    except Exception as e:  # noqa: BLE001  (the CNN's weights download, offline)
        return {"method": f"imagededup {method}", "unavailable": f"{type(e).__name__}: {str(e)[:120]}"}
    held = truth["held_split"]
    pairs = set()
    for a, others in dup.items():
        for b in others:
            sa, sb = a.split("/")[0], b.split("/")[0]
            if sa == "train" and sb == held:
                pairs.add((a, b))
    return {"method": f"imagededup {method}", "seconds": round(time.perf_counter() - t0, 1), **copy_scores(pairs, truth)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="a folder planted.py built (its truth.json beside it)")
    ap.add_argument("--budget", default="5m", help="the label methods' wall-clock budget (5m)")
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument("--model", help="also run vitflow inspect --model RUN")
    ap.add_argument("--size", type=int, default=32, help="the peer loop's image size in px (32)")
    ap.add_argument("--skip", nargs="*", default=[], help="methods to leave out: ours, labels, copies")
    a = ap.parse_args()
    truth = json.loads((a.data.parent / f"{a.data.name}.truth.json").read_text())
    print(json.dumps({"cpu_flags": flags(), "threads": torch.get_num_threads(), "data": str(a.data),
                      "flipped": len(truth["flipped"]), "planted": len(truth["planted"]), "budget": a.budget}))
    results = []
    if "copies" not in a.skip:
        results += [peer_copies(a.data, truth, "PHash"), peer_copies(a.data, truth, "CNN")]
    if "ours" not in a.skip:
        if a.model:
            results.append(ours(a.data, truth, a.budget, a.model))
        results.append(ours(a.data, truth, a.budget, None))
    if "labels" not in a.skip:
        results.append(peer_labels(a.data, truth, parse_duration(a.budget), a.folds, a.size))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
