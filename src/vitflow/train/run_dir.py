"""A run directory belongs to one run.

- A new run writes only into a new or empty folder; a folder holding anything else is refused
  with one line (vitflow never writes into a folder it did not create, and never mixes two runs'
  checkpoints: rotation could delete another run's).
- The folder is created last, after the data and the model are known to be good: a run that
  fails to start leaves no folder behind.
- Created, it holds ``run.json`` (vitflow's mark), the resolved ``config.yaml`` (rewritten at every
  start, resumes included), and the temporary files of checkpoint writes that never finished are
  removed.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
from pathlib import Path

from vitflow import checkpoint as ckpt
from vitflow.config import TrainConfig
from vitflow.data.sources.base import FileSource, ImageSource, export_samples
from vitflow.rundir import CONFIG, RUN, is_run_dir

log = logging.getLogger(__name__)


class RunDirError(ValueError):
    """``train.run_dir`` cannot take this run; the message says what is there and what to do."""


def run_dir_for(t: TrainConfig, preset: str, resume: Path | None) -> Path:
    """Where the run lives: ``train.run_dir``; else the resumed checkpoint's run; else
    ``runs/<preset>-<timestamp>``. Nothing is created."""
    if t.run_dir:
        return Path(t.run_dir)
    if resume is not None:
        return resume.parent.parent
    return Path("runs") / f"{preset}-{dt.datetime.now():%Y%m%d-%H%M%S}"


def check_new_run(path: Path, resume_mode: str) -> bool:
    """For a run that starts from step 0 in ``path``: True when ``path`` is a vitflow run that
    never wrote a checkpoint and ``train.resume=auto`` asks to continue it (it starts over, its
    records emptied); False for a new or empty folder.

    Raises:
        RunDirError: ``path`` holds files: another run's, or not vitflow's at all.
    """
    if not path.exists():
        return False
    if not path.is_dir():
        raise RunDirError(f"train.run_dir={path} is a file, not a folder; choose another train.run_dir")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return False
    if is_run_dir(path) and resume_mode == "auto":
        log.warning("%s holds a run that never wrote a checkpoint: starting it over", path)
        return True
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    if is_run_dir(path):
        raise RunDirError(f"train.run_dir={path} holds another run ({shown}): continue it with `vitflow resume "
                          f"{path}`, or choose a new folder for this run")
    raise RunDirError(f"train.run_dir={path} is not empty ({shown}) and is not a vitflow run: vitflow writes a "
                      "run only into a new or empty folder; choose another train.run_dir")


def open_run_dir(path: Path, config_yaml: str, preset: str) -> Path:
    """Create the run directory (parents too) if needed, mark it as a run (of ``preset``), write
    ``config_yaml`` (the resolved config) and remove unfinished checkpoint writes. A new folder appears whole (written as a hidden
    ``.NAME.partial`` and renamed), so a process killed while creating it leaves no half run.
    Returns ``path``."""
    if not path.exists():
        partial = path.with_name(f".{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _write_files(partial, config_yaml, preset)
        partial.rename(path)
    else:
        _write_files(path, config_yaml, preset)
    for orphan in ckpt.remove_orphans(path):
        log.info("removed %s, the temporary file of a checkpoint write that never finished", orphan)
    return path


def _write_files(path: Path, config_yaml: str, preset: str) -> None:
    """``config.yaml`` (replaced atomically), then the run mark."""
    tmp = path / f".{CONFIG}.tmp"
    tmp.write_text(config_yaml)
    tmp.replace(path / CONFIG)
    if not is_run_dir(path):
        (path / RUN).write_text(json.dumps({"format": "vitflow-run", "version": 1, "preset": preset,
                                            "created": dt.datetime.now().isoformat(timespec="seconds")}))


def write_samples(source: ImageSource, run_dir: Path) -> str | None:
    """For data without image files (the embedded digits, CIFAR batches, packed datasets): a few of
    ``source``'s images written to ``RUN_DIR/samples``, so that ``vitflow predict`` can be tried at
    once; returns the folder, or ``None`` when the images are files already."""
    files = getattr(source, "base", None) or source  # the files behind a RAM cache
    if isinstance(files, FileSource):
        return None
    return str(export_samples(source, run_dir / "samples")[0].parent)
