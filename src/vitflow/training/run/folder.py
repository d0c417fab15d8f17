"""A run directory belongs to one run, written by one process at a time.

- One writer: every start (``train``, ``resume``, a ``sweep`` trial) claims its folder first,
  before any expensive work (:func:`claim_run_dir`): an ``fcntl.flock`` on ``.NAME.lock`` beside
  the folder, held for the life of the process and naming it (pid, host, start time). A second
  start on the same folder refuses with one line naming the holder. A claim left by a process
  that died (SIGKILL, a lost node) is taken over, with a warning. Where the file system has no
  working ``flock`` (some network file systems; or ``VITFLOW_RUN_LOCK=marker``) the claim is the
  atomic creation of that file (``O_EXCL``), with the same messages; a dead holder's marker is
  taken over only on its own host (elsewhere its liveness cannot be known: the message says to
  delete the marker).
- A new run writes only into a new or empty folder; a folder holding anything else is refused
  with one line (vitflow never writes into a folder it did not create, and never mixes two runs'
  checkpoints: rotation could delete another run's).
- The folder is created last, after the data and the model are known to be good, from a staging
  folder unique to the process (``.NAME.partial-HOST-PID``) renamed into place: a run that fails
  to start leaves no folder behind.
- Created, it holds ``run.json`` (vitflow's mark), the resolved ``config.yaml`` (rewritten at every
  start, resumes included), and the temporary files of checkpoint writes that never finished are
  removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import errno
import fcntl
import glob
import json
import logging
import os
import shutil
import socket
import time
import weakref
from pathlib import Path
from typing import Iterator, Sequence

from vitflow import checkpoint as ckpt
from vitflow.config import TrainConfig
from vitflow.config.messages import MESSAGES
from vitflow.data.sources.base import ImageSource, export_samples
from vitflow.data.sources.pyobjects import DatasetSource
from vitflow.rundir import CONFIG, RUN, SAMPLES, is_run_dir
from vitflow.training.objectives.class_weights import write_distribution

log = logging.getLogger(__name__)


class RunDirError(ValueError):
    """``train.run_dir`` cannot take this run; the message says what is there and what to do."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory's claim; the message names it (pid, host, start time)."""


LOCK_ENV = "VITFLOW_RUN_LOCK"  # "marker": claim by an O_EXCL marker even where flock works (flock not shared by nodes)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
_HELD: weakref.WeakSet = weakref.WeakSet()  # this process's claims (a forked child closes their descriptors)


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a claim: process id, host name, start time (ISO 8601, local time, to the second)."""

    pid: int
    host: str
    started: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), dt.datetime.now().isoformat(sep=" ", timespec="seconds"))

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    def alive(self) -> bool | None:
        """Whether the process still runs; ``None`` for a process on another host (unknowable here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def _holder_of(lock: Path, wait: float = 2.0) -> Holder | None:
    """The holder a lock file names (``None`` once it is gone); a record still being written is
    waited for up to ``wait`` seconds (then: a holder of unknown name)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return Holder(**json.loads(lock.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # empty or half-written: its writer is at it
            if time.monotonic() > deadline:
                return Holder(0, "?", "?")
            time.sleep(0.02)


class RunClaim:
    """This process's claim on run directory ``path`` (see the module docstring and
    :func:`claim_run_dir`), held until :meth:`release` (also called when the object is collected
    and at interpreter exit). ``mode``: ``flock``, ``marker`` (the ``O_EXCL`` fallback) or ``none``
    (another rank of a multi-process run: rank 0 holds the claim)."""

    def __init__(self, path: Path, lock: Path | None = None, mode: str = "none", fd: int | None = None,
                 created: Sequence[Path] = (), holder: Holder | None = None):
        self.path, self.lock, self.mode, self.holder = path, lock, mode, holder or Holder.this_process()
        self._fd, self._created, self.held = fd, list(created), mode != "none"
        self._finalizer = weakref.finalize(self, _release, lock, mode, fd, self.holder, self._created)
        if not self.held:
            self._finalizer.detach()
        _HELD.add(self)

    def release(self) -> None:
        """Give the claim up: remove the lock file (and the folders made for it that stayed empty).
        Safe to call more than once."""
        self.held = False
        self._finalizer()  # runs once

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[RunClaim]:
        """Inside the block, an exception releases the claim (a start that fails leaves nothing held)."""
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def forget_in_child(self) -> None:
        """In a forked child: close the descriptor without unlocking (the parent keeps the claim)."""
        if self._finalizer.detach() and self._fd is not None:
            os.close(self._fd)
        self.held = False


def _release(lock: Path, mode: str, fd: int | None, holder: Holder, created: list[Path]) -> None:
    if os.getpid() != holder.pid:  # a forked child's collector: the claim is its parent's
        return
    with contextlib.suppress(OSError):
        if mode == "flock" or _holder_of(lock, 0.0) == holder:  # under flock: ours while we hold it
            lock.unlink()
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # (after the unlink: a waiting process then finds the file gone and opens a new one)
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if still empty


os.register_at_fork(after_in_child=lambda: [c.forget_in_child() for c in list(_HELD)])


def claim_run_dir(path: str | Path) -> RunClaim:
    """Claim run directory ``path`` for this process: the lock file ``PARENT/.NAME.lock`` (parent
    folders made as needed; removed again with the claim when they stay empty) locked with
    ``fcntl.flock`` and holding this process's pid, host and start time. A lock file whose
    ``flock`` is free but whose record names another process (it died holding the claim) is taken
    over with a warning. Where ``flock`` does not work (``ENOLCK`` / ``EOPNOTSUPP``: some network
    file systems) or :data:`LOCK_ENV` is ``marker``, the claim is the lock file's atomic creation.

    Raises:
        RunDirBusy: another process holds the claim (the message names it: pid, host, start time).
    """
    path = Path(path).resolve()
    created = [p for p in reversed(path.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(f".{path.name}.lock")
    me = Holder.this_process()
    try:
        fd = None if os.environ.get(LOCK_ENV, "").lower() == "marker" else _flock(lock, path)
        mode = "flock" if fd is not None else "marker"
        stale = _take_over_previous(fd, lock) if fd is not None else _marker(lock, path, me)
    except BaseException:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    if fd is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dataclasses.asdict(me)).encode(), 0)
        os.fsync(fd)
    if stale is not None:
        gone = {False: "which is no longer running", None: "which no longer holds it (a lost node?)"}.get(
            stale.alive(), "which no longer holds it")
        log.warning("%s: took over the claim left by %s, %s", path, stale, gone)
    return RunClaim(path, lock, mode, fd, created, me)


def _busy(path: Path, holder: Holder | None, extra: str = "") -> RunDirBusy:
    who = holder or "a process that has just ended"
    return RunDirBusy(f"{path} is in use by another vitflow run ({who}){extra}: wait for it to end, or choose "
                      "another train.run_dir")


def _flock(lock: Path, path: Path) -> int | None:
    """The descriptor of ``lock``, ``flock``-ed by this process; ``None`` where ``flock`` does not work."""
    while True:
        try:
            fd, made = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd, made = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(path, _holder_of(lock)) from None
        except OSError as e:
            os.close(fd)
            if made:  # the marker fallback creates it
                lock.unlink(missing_ok=True)
            if e.errno in _NO_FLOCK:
                log.debug("flock does not work beside %s (%s): claiming with a marker file", path, e.strerror)
                return None
            raise
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder released it (and removed the file) meanwhile: take the new one


def _take_over_previous(fd: int, lock: Path) -> Holder | None:
    """The holder a just-``flock``-ed lock file still names: a process that died holding the claim."""
    data = os.pread(fd, 4096, 0)
    try:
        return Holder(**json.loads(data)) if data else None
    except (ValueError, TypeError):
        return None


def _marker(lock: Path, path: Path, me: Holder) -> Holder | None:
    """Claim by creating ``lock`` exclusively (``O_EXCL``); a marker of a dead process on this host
    is replaced (under a ``.takeover`` marker, so that two processes never both do). Returns the dead
    holder replaced, or ``None``."""
    stale = None
    for _ in range(5):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _holder_of(lock)
            if holder is None:
                continue  # released meanwhile
            alive = holder.alive()
            if alive is None:
                raise _busy(path, holder, f"; if that process is gone (a lost node), delete {lock} and start again") \
                    from None
            if alive or not _remove_marker(lock, holder):
                raise _busy(path, holder) from None
            stale = holder
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(dataclasses.asdict(me)))
            f.flush()
            os.fsync(f.fileno())
        return stale
    raise _busy(path, _holder_of(lock))


def _remove_marker(lock: Path, holder: Holder) -> bool:
    """Remove the marker of dead ``holder`` unless another process is replacing it; True if removed."""
    guard = lock.with_name(lock.name + ".takeover")
    try:
        fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - guard.stat().st_mtime > 60:  # left by a process killed while taking over
                guard.unlink()
        return False
    try:
        if _holder_of(lock, 0.0) != holder:
            return False
        lock.unlink()
        return True
    finally:
        os.close(fd)
        guard.unlink(missing_ok=True)


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
    raise RunDirError(MESSAGES["run_dir_taken" if is_run_dir(path) else "run_dir_not_empty"].format(path=path,
                                                                                                   shown=shown))


def create_run_folder(path: Path, config_yaml: str, preset: str, data) -> None:
    """Rank 0, once the data and the model are known to be good: the run directory
    (:func:`open_run_dir`), each split's class counts for the report
    (:func:`~vitflow.training.objectives.class_weights.write_distribution`) and, for data read from files, held-out
    sample images (:func:`write_samples`; a user's Python ``Dataset`` gets them at the end of the run:
    reading it here, before the loader workers fork, would share its lazily opened files with them)."""
    open_run_dir(path, config_yaml, preset)
    write_distribution(path, data)
    held_out = data.val or data.test
    if not isinstance(getattr(held_out, "base", held_out), DatasetSource):
        write_samples(held_out, path)


def open_run_dir(path: Path, config_yaml: str, preset: str) -> Path:
    """Create the run directory (parents too) if needed, mark it as a run (of ``preset``), write
    ``config_yaml`` (the resolved config) and remove unfinished checkpoint writes. The caller holds the
    folder's claim (:func:`claim_run_dir`). A new folder appears whole: written as a hidden
    ``.NAME.partial-HOST-PID`` (unique to this process) and renamed, so a process killed while creating it
    leaves no half run (the next holder of the claim removes what it left). Returns ``path``."""
    if not path.exists():
        for stale in path.parent.glob(f".{glob.escape(path.name)}.partial*"):  # dead processes': we hold the claim
            shutil.rmtree(stale, ignore_errors=True)
        partial = path.with_name(f".{path.name}.partial-{socket.gethostname()}-{os.getpid()}")
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
    """A few held-out images of ``source`` (one per class first; the files themselves for image
    folders and tars, PNGs for data without files: the embedded digits, CIFAR batches, packed
    datasets) in ``RUN_DIR/samples``, written once, at the start of a run: for trying ``vitflow
    predict`` at once, and for the report's sample and attention panels. Returns the folder, or
    ``None`` when no image could be written."""
    folder = run_dir / SAMPLES
    if folder.is_dir() and any(folder.iterdir()):
        return str(folder)
    return str(folder) if export_samples(source, folder) else None
