"""Throughput of ``vitflow inspect``'s one pass over a folder (read, hash, decode, luma views, pHash,
embedding by a model) against a plain embedding loop over the same images with the same model
(torchvision ``ImageFolder`` + ``DataLoader``, PIL decode, the model's eval transform), in one process;
then the whole ``vitflow inspect --model`` on the folder, wall clock.

    python benchmarks/quality/scan_speed.py --data PHOTOS --model RUN [--repeats 3]

Prints images/s of each (the median of ``--repeats``), their ratio and the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vitflow.config import DataConfig  # noqa: E402
from vitflow.infer.features.backbone import load_backbone  # noqa: E402
from vitflow.infer.features.embed import pooled_features  # noqa: E402
from vitflow.quality.inspection import open_splits  # noqa: E402
from vitflow.quality.scan import scan_split  # noqa: E402


def flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in ("amx_tile", "avx512_bf16", "avx2") if f in text})) or "none"


@torch.no_grad()
def plain_loop(folder: Path, backbone, workers: int) -> int:
    from torchvision import datasets
    from torchvision.transforms import v2

    pp = backbone.preprocess
    t = v2.Compose([v2.PILToTensor(), v2.Resize(int(round(pp.image_size / pp.crop_pct)), antialias=True),
                    v2.CenterCrop(pp.image_size), v2.ToDtype(torch.float32, scale=True), v2.Normalize(pp.mean, pp.std)])
    n = 0
    for x, _ in torch.utils.data.DataLoader(datasets.ImageFolder(str(folder), transform=t), batch_size=64,
                                            num_workers=workers):
        pooled_features(backbone.model, x)
        n += len(x)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path, help="class folders with a train split (train/<class>/...)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    bb = load_backbone(a.model)
    bb.model.eval()
    train = open_splits(DataConfig(path=str(a.data)))[0][1]
    ours, theirs = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        scan_split(train, "train", bb, workers=a.workers)
        ours.append(len(train) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        n = plain_loop(a.data / "train", bb, a.workers)
        theirs.append(n / (time.perf_counter() - t0))
    import vitflow

    out = Path("/tmp/scan-speed-inspect")
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    df = vitflow.inspect(str(a.data), model=bb.source, out=out)  # the checkpoint file: no cache beside the run, cold
    whole = time.perf_counter() - t0
    print(json.dumps({"cpu_flags": flags(), "threads": torch.get_num_threads(), "images": len(train),
                      "model": bb.name, "scan_images_per_s": round(statistics.median(ours), 1),
                      "plain_embedding_images_per_s": round(statistics.median(theirs), 1),
                      "ratio": round(statistics.median(ours) / statistics.median(theirs), 2),
                      "inspect_images": sum(df.attrs["summary"]["images"].values()),
                      "inspect_seconds": round(whole, 1)}))


if __name__ == "__main__":
    main()
