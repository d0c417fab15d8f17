"""Launches beyond one node: torchrun's elastic agents (``--nnodes N``, c10d rendezvous,
``--max-restarts``) and Slurm's ``srun``.

- **Slurm without torchrun** (``srun python -m vitflow train ...``, one task per device): the
  scheduler's variables become torch.distributed's (:func:`slurm_env`): ``SLURM_PROCID`` ->
  ``RANK``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``) -> ``WORLD_SIZE``, ``SLURM_LOCALID``
  -> ``LOCAL_RANK``, the first host of the step's node list -> ``MASTER_ADDR`` (``scontrol show
  hostnames`` when it is installed, else vitflow's own parser, :func:`expand_nodelist`) and a
  port derived from ``SLURM_JOB_ID`` -> ``MASTER_PORT`` (variables already set win).
  Under ``srun torchrun`` torchrun's own variables are used as they are.
- **Restarts** (torchrun ``--max-restarts``, a requeued Slurm job): the run directory must be the
  same at every start, so without ``train.run_dir`` it is ``runs/<preset>-<job>`` with the job
  named by ``SLURM_JOB_ID`` or torchrun's ``--rdzv-id`` (:func:`apply_launch`); a restarted start
  (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT`` > 0) continues the run from its
  newest complete checkpoint as ``train.resume=auto`` does.

Reference: torchrun's environment (``torch.distributed.run``); Slurm's srun/sbatch manuals
(output environment variables, ``hostlist`` expressions).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Mapping

from vitflow.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^(.*?)\[([^\]]*)\](.*)$")


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside ``[...]``: ``"a[1,2],b"`` -> ``["a[1,2]", "b"]``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a Slurm node list, in order: ``node[01-03,07]`` -> ``node01, node02,
    node03, node07``; several groups (``a[1-2]-ib,b5``) and several ranges in one name
    (``r[1-2]n[1-2]`` -> ``r1n1, r1n2, r2n1, r2n2``); zero padding kept from the range's start.

    Raises:
        ValueError: an unbalanced bracket or a range that is not ``lo-hi`` with ``lo <= hi``
            (the message names the node list).
    """
    if nodelist.count("[") != nodelist.count("]"):
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
    hosts: list[str] = []
    for group in split_top_level(nodelist):
        m = _RANGE.match(group)
        if not m:
            hosts.append(group)
            continue
        head, ranges, tail = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.strip().partition("-")
            if not lo.isdigit() or (hi and (not hi.isdigit() or int(hi) < int(lo))):
                raise ValueError(f"SLURM node list {nodelist!r}: bad range {item!r}")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.extend(expand_nodelist(f"{head}{n:0{width}d}{tail}"))
    return hosts


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames NODELIST``'s hosts, or ``None`` when scontrol is not installed or fails."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = out.stdout.split()
    return hosts if out.returncode == 0 and hosts else None


def launched_by_srun(environ: Mapping[str, str]) -> bool:
    """True in a task ``srun`` started (it sets ``SLURM_STEP_ID``; a batch script alone does not)."""
    return "SLURM_JOB_ID" in environ and ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ)


def slurm_env(environ: Mapping[str, str],
              hostnames: Callable[[str], list[str] | None] = scontrol_hostnames) -> dict[str, str]:
    """The torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) of a task ``srun`` started without torchrun; ``{}`` when this is not such a
    task, when torchrun set them already (``srun torchrun``) or for a single task. Variables
    already in ``environ`` are kept. ``MASTER_PORT`` defaults to ``20000 + SLURM_JOB_ID mod
    20000``, so two jobs sharing a node do not collide.

    Raises:
        ValueError: a malformed node list or task count (the message names the variable).
    """
    if not launched_by_srun(environ) or "TORCHELASTIC_RUN_ID" in environ or "WORLD_SIZE" in environ:
        return {}
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    if not tasks.isdigit():
        raise ValueError(f"SLURM_STEP_NUM_TASKS / SLURM_NTASKS={tasks!r} is not a task count")
    if int(tasks) <= 1:
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get(
        "SLURM_NODELIST") or "127.0.0.1"
    master = environ.get("MASTER_ADDR") or (hostnames(nodelist) or expand_nodelist(nodelist))[0]
    job = environ["SLURM_JOB_ID"]
    port = environ.get("MASTER_PORT") or str(20000 + int(job) % 20000 if job.isdigit() else 29500)
    return {"RANK": environ.get("SLURM_PROCID", "0"), "WORLD_SIZE": tasks,
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"), "MASTER_ADDR": master, "MASTER_PORT": port}


def adopt_slurm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put :func:`slurm_env`'s variables into ``environ`` (default ``os.environ``) for
    ``init_process_group``; returns them (``{}``: nothing to do)."""
    environ = os.environ if environ is None else environ
    found = slurm_env(environ)
    environ.update(found)
    if found and found["RANK"] == "0":
        log.info("Slurm launch: %s processes, rendezvous at %s:%s", found["WORLD_SIZE"], found["MASTER_ADDR"],
                 found["MASTER_PORT"])
    return found


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was started before: torchrun's ``TORCHELASTIC_RESTART_COUNT``
    plus Slurm's ``SLURM_RESTART_COUNT`` (a requeued job)."""
    return sum(int(environ.get(k, "0") or 0) for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def job_name(environ: Mapping[str, str]) -> str | None:
    """A name for this job that every start of it shares: ``slurm<SLURM_JOB_ID>``, torchrun's
    ``--rdzv-id`` (``TORCHELASTIC_RUN_ID`` unless it is torchrun's default ``none``), else ``None``."""
    if "SLURM_JOB_ID" in environ and (launched_by_srun(environ) or "TORCHELASTIC_RUN_ID" in environ):
        return f"slurm{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None


def restartable(environ: Mapping[str, str]) -> bool:
    """True when this process may be started again for the same run: under torchrun with
    ``--max-restarts`` > 0, in a Slurm task (``--requeue``), or in a restart already."""
    return (int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 or launched_by_srun(environ)
            or restart_count(environ) > 0)


def apply_launch(t: TrainConfig, preset: str, any_rank: Callable[[bool], bool] = bool,
                 environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Make a restartable launch find its own run again (every rank calls it, before the run is
    located; the ``train`` section ``t`` is changed in place and returned):

    - without ``train.run_dir``: ``runs/<preset>-<job name>`` (:func:`job_name`);
    - in a restart with ``train.resume=none``: ``train.resume=auto`` when the run directory exists
      (a start killed before creating it starts from step 0 again). A restart is agreed over the
      ranks with ``any_rank`` (a collective: true on every rank when true on any), because
      torchrun counts restarts per agent: an agent whose own workers did not fail restarts them
      for the others with ``TORCHELASTIC_RESTART_COUNT`` unchanged.

    Raises:
        ConfigError: a restartable launch without ``train.run_dir`` and without a job name
            (torchrun ``--max-restarts`` with the default ``--rdzv-id``).
    """
    environ = os.environ if environ is None else environ
    if not any_rank(restartable(environ)):
        return t
    if not t.run_dir:
        name = job_name(environ)
        if name is None:
            raise ConfigError("train.run_dir is required under torchrun --max-restarts without --rdzv-id: every "
                              "restart must find the run's checkpoints (set train.run_dir=PATH or --rdzv-id NAME)",
                              "train.run_dir")
        t.run_dir = str(Path("runs") / f"{preset}-{name}")
    if any_rank(restart_count(environ) > 0) and t.resume == "none" and Path(t.run_dir).is_dir():
        t.resume = "auto"
        if environ.get("RANK", "0") == "0":
            log.warning("a restart of this job: continuing %s from its newest complete checkpoint", t.run_dir)
    return t
