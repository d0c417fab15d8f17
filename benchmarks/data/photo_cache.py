"""The photo-folder input paths side by side: images/s of the training loader alone (batches
through the device pipeline to model input, no model) and the RAM the split takes, for one
photo folder or tar, in one process.

    python benchmarks/data/photo_cache.py [--path ../shared/data/hymenoptera.tar] [--size 64] [--batches 40]

Paths (the same planned augmentation: random-resized crops of at least a quarter, flips):
- ``resized cache`` (``data.cache_resolution=auto``): photos decoded once at the eval resize
  (``size / crop_pct``, center square), one gather per batch, the crop batched on the device;
- ``full-size cache`` (``data.cache_resolution=full``): photos decoded once as they are, cropped
  and resized per image (the per-image path, its auto worker count);
- ``files`` (``data.max_in_memory=0``): decoded from the files every batch, per image, in worker
  processes.
Rounds rotate the paths; the medians and their ratio to the ``files`` path are printed, with the
bytes of decoded pixels each cache holds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from vitflow.config import DataConfig
from vitflow.data import open_split
from vitflow.data.cache import ListSource
from vitflow.data.pipeline import _cache, train_loader
from vitflow.data.sources.base import TensorSource

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
PATHS = {"resized cache": {"cache_resolution": "auto"}, "full-size cache": {"cache_resolution": "full"},
         "files": {"max_in_memory": 0}}


def cached_bytes(source) -> int:
    if isinstance(source, TensorSource):
        return source.images.numel()
    if isinstance(source, ListSource):
        return sum(im.numel() for im in source.images if im is not None)
    return 0


def loader_ips(source, cfg: DataConfig, size: int, batch: int, batches: int) -> tuple[float, str]:
    loader = train_loader(source, cfg, size, batch, seed=0, device=torch.device("cpu"), num_classes=len(source.classes))
    it = iter(loader)
    loader.device_batch(next(it))  # start-up (workers, first batch) untimed
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _ = loader.device_batch(next(it))
    ips = batches * batch / (time.perf_counter() - t0)
    desc = loader.describe()
    loader.close()
    return ips, desc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=str(SHARED / "hymenoptera.tar"))
    ap.add_argument("--size", type=int, default=64, help="training size in pixels (the plan's on a CPU)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per path and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    files = open_split(args.path, "train")
    sources, cfgs = {}, {}
    for name, keys in PATHS.items():
        cfgs[name] = DataConfig(path=args.path, train_augment="random_resized_crop", scale=(0.25, 1.0), **keys)
        t0 = time.perf_counter()
        sources[name] = _cache(files, cfgs[name], args.size, "train", True) if cfgs[name].max_in_memory else files
        print(f"{name:16s} cache: {cached_bytes(sources[name]) / 1e6:8.1f} MB decoded pixels, "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    results: dict[str, list[float]] = {name: [] for name in PATHS}
    descs = {}
    for r in range(args.rounds):
        order = list(PATHS)[r % len(PATHS):] + list(PATHS)[:r % len(PATHS)]
        for name in order:
            ips, descs[name] = loader_ips(sources[name], cfgs[name], args.size, args.batch, args.batches)
            results[name].append(ips)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()) + " img/s", flush=True)
    base = statistics.median(results["files"])
    for name, v in results.items():
        med = statistics.median(v)
        print(f"{name:16s} {med:8.0f} img/s  {med / base:5.2f}x files  (min {min(v):.0f}, max {max(v):.0f})  "
              f"[{descs[name]}]")


if __name__ == "__main__":
    main()
