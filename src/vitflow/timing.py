"""Timing candidate implementations against each other, for the choices made at run time
(``attention=auto``, ``cpu_bf16_matmul=auto``, the fp32 GEMM, ``precision=auto``), and the record
of those choices.

Every choice made by timing goes through :func:`choose` (or :func:`record`): one record per
process that a training checkpoint keeps (``choices``, :func:`recorded`) and a resumed run takes
back (:func:`adopt`), so that the resumed steps compute as the first ones did; a cache on disk
(:func:`cache_path`, keyed by :func:`machine_fingerprint`: the CPU, GPUs, library versions and
thread count; and by each choice's key: shapes, dtypes, flags), so that a new run on the same
machine does not time again; and, under a multi-process run, rank 0's choice on every rank
(:func:`set_agreement`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import torch

_log = logging.getLogger(__name__)


def tracing() -> bool:
    """Inside torch.compile / torch.export / TorchScript tracing (no timing runs, no data-dependent
    Python there)."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # torch >= 2.5
    return torch.compiler.is_compiling() or exporting() or torch.jit.is_tracing()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(calls: dict[str, Callable[[], object]], rounds: int, device: torch.device = torch.device("cpu"),
            errors: tuple[type[BaseException], ...] = (),
            on_error: Callable[[str, BaseException], None] | None = None) -> dict[str, float]:
    """Each call's fastest time in seconds: one warm-up round, then ``rounds`` timed rounds, the
    order rotating from round to round so that no candidate always runs first. A call that raises
    one of ``errors`` is reported to ``on_error``, not called again, and gets ``inf``; other
    exceptions propagate. Rounds of one call spread over :data:`SPREAD_LIMIT` mark the machine busy:
    a choice made from these times is used and recorded, but not cached (:func:`choose`)."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: set[str] = set()
    for r in range(rounds + 1):  # round 0 warms up
        for n in names[r % len(names):] + names[:r % len(names)]:
            if n in failed:
                continue
            sync(device)
            t0 = time.perf_counter()
            try:
                calls[n]()
                sync(device)
            except errors as e:
                if on_error is not None:
                    on_error(n, e)
                failed.add(n)
                continue
            if r:
                times[n].append(time.perf_counter() - t0)
    _STATE["busy"] = _busy({n: t for n, t in times.items() if n not in failed and t})
    return {n: float("inf") if n in failed else min(times[n]) for n in names}


def _busy(times: dict[str, list[float]]) -> dict[str, float]:
    """The candidates whose timed rounds spread over :data:`SPREAD_LIMIT` (calls of
    :data:`BUSY_MIN_S` and more: shorter ones jitter on a quiet machine too), ``{}`` when none or
    when the fastest's slowest round still beats every round of the next (a choice no load flipped)."""
    wide = wide_spreads(times, SPREAD_LIMIT, BUSY_MIN_S)
    ranked = sorted(times, key=lambda n: min(times[n]))
    if wide and len(ranked) > 1 and max(times[ranked[0]]) < min(times[ranked[1]]):
        return {}
    return wide


SPREAD_LIMIT = 0.2  # rounds of one measurement further apart than this (relative to their median): a busy machine
BUSY_MIN_S = 5e-4  # calls shorter than this are not taken as a sign of a busy machine (timer and cache jitter)


def spread(values: Sequence[float]) -> float:
    """How far apart repeated measurements are: ``(max - min) / median`` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("inf")


def wide_spreads(measured: Mapping[str, Sequence[float]], limit: float = SPREAD_LIMIT,
                 shortest: float = 0.0) -> dict[str, float]:
    """``{name: spread}`` of the measurements (name -> rounds: seconds, images/s, ...) whose rounds
    spread more than ``limit`` (:func:`spread`), leaving out those whose median is under ``shortest``
    (in the rounds' unit)."""
    return {k: spread(v) for k, v in measured.items() if v and statistics.median(v) >= shortest and spread(v) > limit}


def busy_warning(measured: dict[str, Sequence[float]], limit: float = SPREAD_LIMIT) -> str | None:
    """A warning naming the measurements (name -> rounds) whose rounds spread more than ``limit``,
    or ``None``: their figures are unreliable, the machine was busy."""
    wide = wide_spreads(measured, limit)
    if not wide:
        return None
    return ("the machine looks busy: rounds of " + ", ".join(f"{k} spread {s:.0%}" for k, s in wide.items())
            + f" (over {limit:.0%}); these figures are unreliable, measure again on an idle machine")


# ---------------------------------------------------------------------------------------------
# the choices made by timing: one record per process, kept in checkpoints, cached per machine

CACHE_ENV = "VITFLOW_CHOICES_CACHE"  # the cache file; "off" (or "0", "none") keeps none
CACHE_FORMAT, CACHE_VERSION = "vitflow-choices", 2  # 2: only choices timed on a quiet machine (1 kept busy ones)
_TABLES: dict[str, dict] = {}  # kind -> this process's choices, key (a tuple) -> choice: the choosers' own tables
_KNOWN: dict[str, dict[str, str]] = {}  # kind -> str(key) -> choice: a resumed checkpoint's (adopt)
_STATE: dict[str, Any] = {"retime": False, "agree": None, "local": 0, "cache": None, "said": False, "busy": {},
                          "said_busy": False}


def choice_table(kind: str) -> dict:
    """This process's table of ``kind``'s choices (``key -> choice``; the key any hashable whose
    ``str`` is stable across processes, e.g. a tuple of shapes, dtypes and flags); the chooser
    (``attention``, ``bf16_matmul``, ``fp32_gemm``, ``precision``) keeps it as its own."""
    return _TABLES.setdefault(kind, {})


def choose(kind: str, key: Hashable, time_it: Callable[[], str]) -> str:
    """The choice of ``kind`` for ``key``: this process's; else a resumed checkpoint's
    (:func:`adopt`); else the machine's cache (an earlier process's, unless :func:`set_retime`);
    else ``time_it()``, then cached. Under a multi-process run (:func:`set_agreement`) every rank
    gets rank 0's (every rank must call it for the same keys in the same order)."""
    table = choice_table(kind)
    if key in table:
        return table[key]
    value = remembered(kind, key)
    if value is None:
        _STATE["busy"] = {}  # what time_it's own timing finds
        value = time_it()
        value = _agree(value)
        _cache_store(kind, str(key), value)
    else:
        value = _agree(value)
    table[key] = value
    return value


def remembered(kind: str, key: Hashable) -> str | None:
    """``kind``'s choice for ``key`` without timing: this process's, a resumed checkpoint's or the
    machine's cache's (unless :func:`set_retime`); ``None`` when none. (Not agreed between ranks:
    see :func:`choose` / :func:`record`.)"""
    table, text = choice_table(kind), str(key)
    if key in table:
        return table[key]
    if text in _KNOWN.get(kind, {}):
        return _KNOWN[kind][text]
    if _STATE["retime"]:
        return None
    value = _cache().get(kind, {}).get(text)
    if value is not None and not _STATE["said"]:
        _STATE["said"] = True
        _log.info("choices made by timing: reusing an earlier run's on this machine (%s; --retime times them again)",
                  cache_path())
    return value


def record(kind: str, key: Hashable, value: str, timed: bool = True) -> str:
    """Record ``value`` as ``kind``'s choice for ``key`` (rank 0's under a multi-process run);
    ``timed``: just measured, so cached too. Returns the recorded value."""
    value = _agree(value)
    choice_table(kind)[key] = value
    if timed:
        _cache_store(kind, str(key), value)
    return value


def recorded() -> dict[str, dict[str, str]]:
    """Every choice made (or taken) in this process: ``{kind: {str(key): choice}}``, what a
    checkpoint keeps (``choices``)."""
    out = {kind: dict(known) for kind, known in _KNOWN.items()}
    for kind, table in _TABLES.items():
        out.setdefault(kind, {}).update({str(k): v for k, v in table.items()})
    return {k: v for k, v in out.items() if v}


def adopt(choices: Mapping[str, Mapping[str, str]]) -> int:
    """Take a checkpoint's :func:`recorded` choices as this process's (they win over the cache and
    over this process's own); returns how many."""
    for kind, known in choices.items():
        _KNOWN.setdefault(kind, {}).update(known)
        table = choice_table(kind)
        for key in [k for k in table if str(k) in known]:
            table[key] = known[str(key)]
    return sum(len(v) for v in choices.values())


def forget(kind: str | None = None) -> None:
    """Forget ``kind``'s choices in this process (every kind's when ``None``: as a new process
    has them), adopted ones included (the cache stays)."""
    for name in [kind] if kind is not None else list({*_TABLES, *_KNOWN}):
        choice_table(name).clear()
        _KNOWN.pop(name, None)
    if kind is None:
        _STATE.update(said=False, said_busy=False, busy={})  # the once-per-process log lines too


def set_retime(retime: bool) -> None:
    """``True``: choose by timing again (``--retime``): this process's choices are forgotten and the
    cache is not read (it is rewritten); ``False``: the default."""
    _STATE["retime"] = bool(retime)
    if retime:
        forget()


def set_agreement(agree: Callable[[str], str] | None) -> None:
    """Under a multi-process run: ``agree(choice)`` returns rank 0's choice on every rank (a
    broadcast), applied to every new choice; ``None``: each process its own."""
    _STATE["agree"] = agree


@contextlib.contextmanager
def local_choices() -> Iterator[None]:
    """Inside the block new choices are not agreed between ranks (an evaluation, whose ranks may see
    different shapes)."""
    _STATE["local"] += 1
    try:
        yield
    finally:
        _STATE["local"] -= 1


def _agree(value: str) -> str:
    agree = _STATE["agree"]
    return agree(value) if agree is not None and not _STATE["local"] else value


@functools.cache
def cpu_flags() -> str:
    """The CPU's model name and flag list (``/proc/cpuinfo``; the machine name elsewhere)."""
    found = {"model name": "", "flags": ""}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name = line.split(":")[0].strip()
            if name in found and not found[name]:
                found[name] = line
    except OSError:
        pass
    return "\n".join(v for v in found.values() if v) or platform.machine()


def machine_fingerprint() -> str:
    """16 hex digits naming what a timed choice depends on: the CPU (model and flags), the GPUs,
    PyTorch's and vitflow's versions and the thread count."""
    try:
        version = importlib.metadata.version("vitflow")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    text = "\n".join([cpu_flags(), *gpus, torch.__version__, version, f"threads {torch.get_num_threads()}"])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_path() -> Path | None:
    """The cache file (:data:`CACHE_ENV`, default ``$XDG_CACHE_HOME/vitflow/choices.json`` or
    ``~/.cache/vitflow/choices.json``), ``None`` when turned off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(value) if value else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vitflow" / \
        "choices.json"


def _cache() -> dict[str, dict[str, str]]:
    """This machine's section of the cache file, read once per process (``{}`` when none or unreadable)."""
    where = (cache_path(), machine_fingerprint())
    if _STATE["cache"] is None or _STATE["cache"][0] != where:
        _STATE["cache"] = (where, _read_cache(where[0]).get(where[1], {}).get("choices", {}))
    return _STATE["cache"][1]


def _read_cache(path: Path | None) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and data.get("format") == CACHE_FORMAT and data.get("version") == CACHE_VERSION
    return data.get("machines", {}) if ok else {}


def _cache_store(kind: str, key: str, value: str) -> None:
    """Add a timed choice to the cache file (merged under a lock, replaced atomically); a cache
    that cannot be written is skipped (logged at debug level). A choice whose timing found the
    machine busy (the last :func:`fastest`) is not cached: other processes' load can make the slower
    candidate win, and a cached choice would outlive that load in every later run (measured here:
    choices cached under load made later bf16 inference 0.6x as fast as freshly timed ones)."""
    path = cache_path()
    if path is None:
        return
    if _STATE["busy"]:
        if not _STATE["said_busy"]:
            _STATE["said_busy"] = True
            _log.info("choices made by timing: not cached, the machine looked busy (rounds of %s over %.0f%% apart); "
                      "this run uses them and its checkpoints record them",
                      ", ".join(f"{n} {s:.0%}" for n, s in _STATE["busy"].items()), SPREAD_LIMIT * 100)
        return
    _cache().setdefault(kind, {})[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            machines = _read_cache(path)
            mine = machines.setdefault(machine_fingerprint(), {"choices": {}})
            mine.setdefault("choices", {}).setdefault(kind, {})[key] = value
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "machines": machines}))
            tmp.replace(path)
    except OSError as e:
        _log.debug("choices cache %s not written: %s", path, e)
