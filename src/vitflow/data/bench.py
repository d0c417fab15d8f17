"""``vitflow bench data``: input-pipeline throughput, side by side in one run.

Paths measured (images/s over full passes, same image size, augmentation and worker count):

- ``decode_limit``: full-size decoding alone (the decoder vitflow uses, bytes already in RAM), 1
  process and one process per core; a random-resized-crop path can pass it, since it decodes
  large JPEGs at a reduced DCT scale when the crop allows;
- ``baseline``: torchvision ``ImageFolder`` + ``DataLoader`` (PIL decode, transforms v1 with
  ``ToTensor`` + ``Normalize`` in the workers), on a copy of the images extracted to a temporary
  folder (page cache warm), in a fresh Python process as a user's script; the same augmentation
  as vitflow's ``auto``: a random-resized crop above 64 px, else resize to the size, pad by 4 and
  crop (the CIFAR recipe), then a flip;
- ``vitflow``: vitflow's loader reading the folder or tar in place (no RAM cache), finished by
  its device pipeline (normalised float32 batches, like the baseline's); WebDataset shards are
  streamed as training streams them (:mod:`vitflow.data.wds.stream`);
- ``packed``: vitflow's loader on a packed copy (``vitflow prepare``: raw at <= 64 px when the
  images share one size, else JPEG at ``max_side``);
- ``folder`` (for a label file or a Hugging Face dataset only): vitflow's loader on the same images
  as a folder (the baseline's copy), so the table-backed source is compared with a folder in the
  same run;
- ``compare`` (``--compare PATH``, repeatable): vitflow's loader on other copies of the data (a
  tar read in place against its WebDataset shards, local shards against the same shards over
  HTTP), in the same repeats as ``vitflow``, each with the median of its per-repeat ratio to it.

Paths are interleaved across repeats (``vitflow`` and the compared paths in alternating order);
the medians are reported with their ratio to the baseline.
Images that cannot be read or decoded are left out of every path, with one warning (:func:`readable`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vitflow.config import DataConfig
from vitflow.data.decode import CorruptImageError, decode_image
from vitflow.data.pipeline import train_loader
from vitflow.data.sources.base import DataError, ImageSource
from vitflow.data.sources.dispatch import kind_of, open_split, open_training
from vitflow.data.sources.folder import open_class_folders, open_images
from vitflow.data.sources.packed import FORMAT, VERSION, common_size, open_packed, write_split
from vitflow.data.transforms import resolve_augment
from vitflow.runtime import configure_allocator, settled_heap
from vitflow.timing import busy_warning

log = logging.getLogger(__name__)

_BYTES: list[bytes] = []


def _decode_range(bounds: tuple[int, int]) -> int:
    torch.set_num_threads(1)
    for data in _BYTES[bounds[0]:bounds[1]]:
        decode_image(data)
    return bounds[1] - bounds[0]


def decode_limit(source: ImageSource, processes: int) -> float:
    """Images/s of :func:`decode_image` alone over ``source``'s encoded bytes held in RAM."""
    global _BYTES
    _BYTES = [source.encoded(i) for i in range(len(source))]
    n = len(_BYTES)
    t0 = time.perf_counter()
    if processes <= 1:
        _decode_range((0, n))
    else:
        step = -(-n // (processes * 4))
        with mp.get_context("fork").Pool(processes) as pool:
            t0 = time.perf_counter()  # pool start-up excluded: this is the decoder's own limit
            sum(pool.map(_decode_range, [(a, min(a + step, n)) for a in range(0, n, step)]))
    return n / (time.perf_counter() - t0)


def readable(source: ImageSource) -> ImageSource:
    """``source`` without the images that cannot be read or decoded (a truncated shard's cut
    sample, a corrupt file), which every path would otherwise trip on or skip differently; one
    warning names the first and counts them. Decodes each image once."""
    good, bad = [], []
    for i in range(len(source)):
        try:
            decode_image(source.encoded(i), source.name(i))
            good.append(i)
        except CorruptImageError as e:
            bad.append(f"{e.path}: {e.reason}")
    if not bad:
        return source
    log.warning("%d unreadable image(s) left out of the benchmark (first: %s)", len(bad), bad[0])
    return source.subset(np.asarray(good, dtype=np.int64))


def _extract(source: ImageSource, folder: Path) -> Path:
    """The encoded images of ``source`` as ``folder/<class>/<index>.<ext>`` (multi-label sources:
    one folder ``images``), in ``source`` order."""
    for i in range(len(source)):
        d = folder / (source.classes[int(source.labels[i])] if source.labels.ndim == 1 else "images")
        d.mkdir(parents=True, exist_ok=True)
        ext = os.path.splitext(source.name(i).rstrip(")"))[1]
        (d / f"{i:07d}{ext if ext.lower() in ('.jpg', '.jpeg', '.png', '.webp', '.bmp') else '.jpg'}").write_bytes(
            source.encoded(i))
    return folder


def baseline_ips(folder: Path, image_size: int, batch_size: int, workers: int, passes: int, mean, std) -> float:
    """torchvision ImageFolder + DataLoader images/s (workers re-forked each pass, the default),
    measured in a fresh Python process, as a user's script would run (no vitflow settings)."""
    import subprocess
    import sys

    args = json.dumps([str(folder), image_size, batch_size, workers, passes, list(mean), list(std)])
    out = subprocess.run([sys.executable, "-c", f"from vitflow.data.bench import _baseline; _baseline({args!r})"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _baseline(args: str) -> None:
    folder, image_size, batch_size, workers, passes, mean, std = json.loads(args)
    import torchvision
    from torchvision import transforms as T

    if image_size <= 64:  # vitflow's pad_crop: resized to the size (a no-op for CIFAR), padded, cropped
        bilinear = T.InterpolationMode.BILINEAR
        aug = [T.Resize((image_size, image_size), bilinear), T.RandomCrop(image_size, padding=4),
               T.RandomHorizontalFlip()]
    else:
        aug = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
    ds = torchvision.datasets.ImageFolder(str(folder), T.Compose(aug + [T.ToTensor(), T.Normalize(mean, std)]))
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, drop_last=True)
    n, t0 = 0, time.perf_counter()
    for _ in range(passes):
        for x, _y in loader:
            n += len(x)
    print(n / (time.perf_counter() - t0))


def vitflow_ips(source: ImageSource, cfg: DataConfig, image_size: int, batch_size: int, passes: int) -> float:
    """vitflow loader + device pipeline (CPU) images/s over ``passes`` epochs."""
    tl = train_loader(source, cfg, image_size, batch_size, seed=0, device=torch.device("cpu"), num_classes=1000,
                      epochs=passes)
    per_epoch = tl.batches_per_epoch
    with settled_heap():  # as training's loop runs
        n, t0 = 0, time.perf_counter()
        it = iter(tl)
        for _ in range(passes * per_epoch):
            x, _y = tl.device_batch(next(it))
            n += len(x)
        elapsed = time.perf_counter() - t0
    tl.close()
    return n / elapsed


def _open(path: str, label: str = "--data") -> ImageSource:
    try:
        return open_split(path, "train", label=label)
    except DataError:
        return open_images(path)  # a flat folder of images (e.g. the ImageNet sample)


def _fills_a_batch(name: str, images: int, batch_size: int) -> None:
    """Raises ValueError, naming ``name`` and the ``--batch-size`` to give, when ``images`` cannot
    fill one batch of ``batch_size``."""
    if images < batch_size:
        raise ValueError(f"{name} has {images} images, fewer than one batch of {batch_size}: give --batch-size "
                         f"{max(1, images // 2)} or less")


def _compared(path: str, images: int, batch_size: int) -> ImageSource:
    """``--compare path`` as vitflow's training loader reads it (WebDataset shards streamed, other
    sources by random access without their unreadable images); a warning when it does not hold
    ``images`` images (then not a copy of ``--data``).

    Raises:
        DataError: ``path`` cannot be read (the message names it).
        ValueError: fewer images than one batch.
    """
    streams = kind_of(path, label="--compare").stream is not None
    src = open_training(DataConfig(path=path), "--compare") if streams else readable(_open(path, "--compare"))
    _fills_a_batch(f"--compare {path}", len(src), batch_size)
    if len(src) != images:
        log.warning("--compare %s holds %d images, --data %d: not a copy of the same data; its ratio compares "
                    "different images", path, len(src), images)
    return src


def _compare_lines(path: str, results: dict[str, list[float]], compare: dict[str, ImageSource], emit) -> dict:
    """Each compared path's median images/s (``results["--compare PATH"]``) and median per-repeat
    ratio to ``path``'s loader, emitted one line each; returns ``{path: {"ips", "ratio"}}``."""
    out = {}
    for p in compare:
        ips = results[f"--compare {p}"]
        ratios = [a / b for a, b in zip(ips, results["vitflow"])]
        out[p] = {"ips": statistics.median(ips), "ratio": statistics.median(ratios)}
        emit(f"{p}: {out[p]['ips']:.0f} img/s, {out[p]['ratio']:.3f}x {path} (median of the repeats' own ratios: "
             + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    return out


def run(path: str, image_size: int = 224, workers: int = 2, repeats: int = 3, passes: int | None = None,
        batch_size: int | None = None, max_side: int | None = None, emit=print,
        compare: Sequence[str] = ()) -> dict:
    """Measure the paths of the module docstring; returns the medians ``{"decode_limit_ips",
    "baseline_ips", "vitflow_ips", "packed_ips"}`` (and ``"folder_ips"`` for a label file or a
    Hugging Face dataset; ``"compare": {path: {"ips", "ratio"}}`` for ``compare``'s paths) and
    prints a table with ratios to the baseline.

    Raises:
        DataError: a path that cannot be read (the message names it).
        ValueError: fewer images than one batch.
    """
    configure_allocator()
    source = readable(_open(path))
    kind = kind_of(path)
    table = kind.table_labels
    streamed = open_training(DataConfig(path=path)) if kind.stream is not None else None  # shards: as training reads
    small = image_size <= 64
    batch_size = batch_size or (256 if small else 64)
    _fills_a_batch(path, len(source), batch_size)
    compared = {p: _compared(p, len(streamed or source), batch_size) for p in compare}
    passes = passes or (1 if len(source) > 20_000 else 3)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    cfg = DataConfig(path=path, num_workers=workers, max_in_memory=0, train_augment="auto",
                     interpolation="bilinear", mean=mean, std=std)  # bilinear: as the baseline's RandomResizedCrop
    emit(f"{path}: {len(source)} images, {image_size}px, {resolve_augment('auto', image_size)} + flip, "
         f"{workers} workers, batch {batch_size}, {passes} pass(es) per repeat, {repeats} repeats")
    results: dict[str, list[float]] = {"baseline": [], "vitflow": [], "packed": [], **({"folder": []} if table else {})}
    with tempfile.TemporaryDirectory(prefix="vitflow-bench-") as tmp:
        folder = _extract(source, Path(tmp) / "folder")
        raw = small and common_size(source) is not None  # raw packing needs one image size (photos at <= 64 px: jpeg)
        info = write_split(source, Path(tmp) / "packed" / "train", "raw" if raw else "jpeg",
                            max_side or (None if raw else 256), 90, os.cpu_count() or 1, "pack")
        meta = {"format": FORMAT, "version": VERSION, "classes": source.classes, "splits": {"train": info}}
        (Path(tmp) / "packed" / "meta.json").write_text(json.dumps(meta))
        packed = open_packed(Path(tmp) / "packed", "train")
        dec1 = decode_limit(source, 1)
        decn = decode_limit(source, os.cpu_count() or 1)
        for r in range(repeats):
            results["baseline"].append(baseline_ips(folder, image_size, batch_size, workers, passes, mean, std))
            loaders = [("vitflow", path, streamed or source),
                       *((f"--compare {p}", p, src) for p, src in compared.items())]  # keys apart from the paths
            for k, p, src in loaders if r % 2 == 0 else loaders[::-1]:  # alternating: no path always runs first
                results.setdefault(k, []).append(vitflow_ips(src, dataclasses.replace(cfg, path=p), image_size,
                                                             batch_size, passes))
            results["packed"].append(vitflow_ips(packed, cfg, image_size, batch_size, passes))
            if table:
                results["folder"].append(vitflow_ips(open_class_folders(folder, "train"), cfg, image_size,
                                                     batch_size, passes))
            emit(f"  repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()) + " img/s")
    out = _report(path, results, table, dec1, decn, emit)
    return {**out, "compare": _compare_lines(path, results, compared, emit)} if compared else out


def _report(path: str, results: dict[str, list[float]], table: bool, dec1: float, decn: float,
            emit) -> dict[str, float]:
    """The table of :func:`run` (medians, ratios to the baseline) and its returned medians."""
    med = {k: statistics.median(v) for k, v in results.items() if not k.startswith("--compare ")}
    base = med["baseline"]
    emit(f"decode limit     {dec1:9.0f} img/s (1 process)  {decn:9.0f} img/s ({os.cpu_count()} processes)")
    labels = (("baseline", "torchvision"), ("vitflow", "vitflow"), ("packed", "vitflow packed"),
              ("folder", "vitflow folder"))
    for k, label in labels[:4 if table else 3]:
        emit(f"{label:16s} {med[k]:9.0f} img/s  {med[k] / base:5.2f}x baseline  "
             f"(min {min(results[k]):.0f}, max {max(results[k]):.0f})")
    if table:
        ratios = [a / b for a, b in zip(results["vitflow"], results["folder"])]
        emit(f"{path} / the same images as a folder: {statistics.median(ratios):.2f}x (per repeat: "
             + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    if warning := busy_warning(results):
        log.warning("%s", warning)
    out = {"decode_limit_ips": decn, "baseline_ips": base, "vitflow_ips": med["vitflow"], "packed_ips": med["packed"]}
    return {**out, "folder_ips": med["folder"]} if table else out
