"""Where a split's statistics (:mod:`vitflow.data.stats.measure`) are kept, and ``data.normalize=dataset``.

They are measured once (``vitflow prepare --stats``, or by training at start-up) and kept in a
small JSON file keyed by the split's content fingerprint (:func:`~vitflow.data.stats.split_fingerprint`):

- beside the data (:func:`sidecar_path`): inside a ``data.path`` folder (an image folder, a packed
  dataset, a folder of shards, a Hugging Face dataset, CIFAR batches) as ``.vitflow-stats.json``
  (hidden, so that no folder scan sees it); beside a ``data.path`` file (a tar, a label file) as
  ``FILE.vitflow-stats.json``; for a shard pattern or list, in the first shard's folder;
- where the data cannot take a file (a read-only folder or mount, remote data, the embedded
  digits) or already holds a file of that name that is not vitflow's (never overwritten), in a
  cache folder (:func:`cache_path`): ``data.cache_dir/vitflow-stats/FINGERPRINT.json`` when
  ``data.cache_dir`` is set, else ``$XDG_CACHE_HOME/vitflow/stats/FINGERPRINT.json`` (default
  ``~/.cache/vitflow/stats``). Where an entry went is logged.

A file holds ``{"format": "vitflow-stats", "version": 1, "splits": {FINGERPRINT: {"split", "data",
"mean", "std", "images", "pixels", "skipped", "sample", "seconds", "measured"}}}``; a sidecar
keeps one entry per split it has seen (``train`` and ``train[:90%]`` side by side), a write adds
to the entries there (written to a temporary file, then renamed over).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from vitflow.config import ConfigError, DataConfig
from vitflow.data.remote.fs import is_remote
from vitflow.data.sources.dispatch import open_split, source_kind
from vitflow.data.stats.measure import DatasetStats, fmt3, measure, split_fingerprint

log = logging.getLogger(__name__)

FORMAT, VERSION = "vitflow-stats", 1
SIDECAR = ".vitflow-stats.json"
SAME = 1e-4  # data.mean / data.std set by hand that agree with the measured ones to this are the same numbers


def sidecar_path(path: str | Path | None, source: str = "auto") -> Path | None:
    """The statistics file beside the data at ``path`` (see the module text), or ``None`` where
    there is no local place (remote data, the embedded digits)."""
    if path is None or source == "digits" or is_remote(path):
        return None
    p = Path(path).expanduser()
    if not p.exists() and source_kind(path, source) == "wds":  # a shard pattern or :: list: its first shard's folder
        first = str(path).split("::")[0]
        return None if is_remote(first) else Path(first).expanduser().parent / SIDECAR
    return p / SIDECAR if p.is_dir() else p.with_name(p.name + SIDECAR)


def cache_path(fingerprint: str, cache_dir: str | None = None) -> Path:
    """The cache folder's file for ``fingerprint`` (see the module text)."""
    if cache_dir:
        return Path(cache_dir).expanduser() / "vitflow-stats" / f"{fingerprint}.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitflow" / "stats" / f"{fingerprint}.json"


def _entries(file: Path) -> dict | None:
    """The ``splits`` mapping of a statistics file; ``{}`` when absent; ``None`` when the file is
    not one of vitflow's (or unreadable)."""
    if not file.exists():
        return {}
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("splits"), dict):
        return None
    return doc["splits"]


def load_stats(fingerprint: str, sidecar: Path | None, cache_dir: str | None = None
               ) -> tuple[DatasetStats, Path] | None:
    """The statistics stored for ``fingerprint`` and the file they came from (the sidecar first,
    then the cache), or ``None``. A malformed entry is logged and ignored."""
    for file in filter(None, (sidecar, cache_path(fingerprint, cache_dir))):
        entry = (_entries(file) or {}).get(fingerprint)
        if entry is None:
            continue
        try:
            return DatasetStats.from_dict(entry), file
        except (KeyError, TypeError, ValueError) as e:
            log.warning("%s: ignoring a malformed statistics entry %s (%s)", file, fingerprint, e)
    return None


def store_stats(stats: DatasetStats, fingerprint: str, split: str, sidecar: Path | None,
                cache_dir: str | None = None, data: str | None = None) -> Path:
    """Write ``stats`` under ``fingerprint`` (with the ``split`` expression and the ``data`` path, for
    the reader) into the sidecar, or into the cache folder when the sidecar cannot be written or is
    not vitflow's (logged); returns the file written.

    Raises:
        OSError: the cache folder cannot be written either.
    """
    entry = {"split": split, "data": data, **stats.to_dict(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if sidecar is not None:
        entries = _entries(sidecar)
        if entries is None:
            log.warning("%s exists and is not a vitflow statistics file: left as it is", sidecar)
        elif not writable(sidecar.parent):
            log.info("the data's folder %s is read-only: statistics not stored beside the data", sidecar.parent)
        else:
            try:
                return _write(sidecar, {**entries, fingerprint: entry})
            except OSError as e:
                log.info("cannot write %s (%s)", sidecar, e.strerror or e)
    file = cache_path(fingerprint, cache_dir)
    file.parent.mkdir(parents=True, exist_ok=True)
    _write(file, {**(_entries(file) or {}), fingerprint: entry})
    log.info("statistics stored in the cache folder: %s", file)
    return file


def writable(folder: Path) -> bool:
    """Whether vitflow may add a file to ``folder``: the process can write there, and the folder is
    not marked read-only (no write permission bit at all: respected even by root, which the
    permission check lets through)."""
    try:
        return os.access(folder, os.W_OK) and bool(folder.stat().st_mode & 0o222)
    except OSError:
        return False


def _write(file: Path, entries: dict) -> Path:
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "splits": entries}, indent=1) + "\n")
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return file


def _workers(d: DataConfig) -> int:
    return min(os.cpu_count() or 1, 8) if d.num_workers == "auto" else max(1, int(d.num_workers))


def measure_split(d: DataConfig, sample: int | None = None, workers: int | None = None
                  ) -> tuple[DatasetStats, str, Path]:
    """Measure the statistics of ``d.train_split`` of ``d.path`` now and store them (replacing an
    entry of the same fingerprint): ``(stats, fingerprint, file written)``. ``vitflow prepare
    --stats``.

    Raises:
        DataError: see :func:`~vitflow.data.sources.dispatch.open_split`; ValueError: no readable
        image, ``sample`` < 1; OSError: nowhere to write.
    """
    source = open_split(d.path, d.train_split, d.source, cfg=d)
    fingerprint = split_fingerprint(source)
    stats = measure(source, sample, workers or _workers(d), desc=f"statistics {d.train_split}")
    return stats, fingerprint, store_stats(stats, fingerprint, d.train_split, sidecar_path(d.path, d.source),
                                           d.cache_dir, d.path)


def dataset_normalization(d: DataConfig, origins: dict[str, str] | None = None) -> DatasetStats:
    """``data.normalize=dataset``: set ``d.mean`` and ``d.std`` to the statistics of
    ``d.train_split``: the stored ones of its fingerprint, else measured now (over every image) and
    stored; logged with where they came from (and, when measured, how long it took).

    Args:
        origins: where each config key was set (``Config.key_origins``); ``data.mean`` /
            ``data.std`` set by the user (not by a preset) must agree with the measured figures
            (to 1e-4: a saved config of a run with these statistics); ``None``: values other than
            the defaults count as set by the user.
    Raises:
        ConfigError: ``data.mean`` or ``data.std`` set by the user to other numbers; DataError,
        ValueError, OSError as :func:`measure_split`.
    """
    source = open_split(d.path, d.train_split, d.source, cfg=d)
    fingerprint, sidecar = split_fingerprint(source), sidecar_path(d.path, d.source)
    found = load_stats(fingerprint, sidecar, d.cache_dir)
    if found is not None:
        stats, file = found
        log.info("data.normalize=dataset: %s of %s, from %s", stats.describe(), d.train_split, file)
    else:
        log.info("data.normalize=dataset: no statistics stored for %s (fingerprint %s): measuring them over its %d "
                 "images", d.train_split, fingerprint, len(source))
        stats = measure(source, None, _workers(d), desc=f"statistics {d.train_split}")
        file = store_stats(stats, fingerprint, d.train_split, sidecar, d.cache_dir, d.path)
        log.info("data.normalize=dataset: %s of %s, measured in %.1f s, stored in %s", stats.describe(),
                 d.train_split, stats.seconds, file)
    _check_user_values(d, stats, origins)
    if (tuple(d.mean), tuple(d.std)) != (stats.mean, stats.std):
        log.info("data.normalize=dataset: these replace mean %s, std %s", fmt3(d.mean), fmt3(d.std))
    d.mean, d.std = stats.mean, stats.std
    return stats


def _check_user_values(d: DataConfig, stats: DatasetStats, origins: dict[str, str] | None) -> None:
    default = DataConfig()
    for key, value, measured in (("mean", d.mean, stats.mean), ("std", d.std, stats.std)):
        origin = (origins or {}).get(f"data.{key}")
        user = (origin is not None and not origin.startswith("preset ")) if origins is not None else \
            tuple(value) != tuple(getattr(default, key))
        if user and max(abs(a - b) for a, b in zip(value, measured)) > SAME:
            where = f" (in {origin})" if origin else ""
            raise ConfigError(f"data.{key}={list(value)}{where} disagrees with data.normalize=dataset, which measured "
                              f"{fmt3(measured)} on {d.train_split}: drop data.{key} or set data.normalize=config",
                              f"data.{key}")

