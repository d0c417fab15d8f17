"""Slurm and torchrun environments -> rank, world size, master address, run directory and the
implicit resume (pure functions of the environment: no scheduler needed)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from vitflow.config import ConfigError, build_config
from vitflow.training.run.preempt import Preemption, exit_code
from vitflow.training.scale.elastic import apply_launch, expand_nodelist, restart_count, slurm_env


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
    ("a[1-2]-ib,b5", ["a1-ib", "a2-ib", "b5"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("c1,c[3,5]", ["c1", "c3", "c5"]),
])
def test_nodelist_expands_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[3-1]", "node[a-b]"])
def test_malformed_nodelist_is_named(bad):
    with pytest.raises(ValueError, match=r"SLURM node list .*" + bad[:4]):
        expand_nodelist(bad)


SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "node[01-03,07]",
        "SLURM_NODELIST": "node[01-03,07]"}


def test_srun_task_maps_to_torch_distributed_variables():
    assert slurm_env(SRUN, hostnames=lambda _: None) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "23456"}
    # scontrol's answer wins over the parser; set variables win over both
    assert slurm_env(SRUN, hostnames=lambda nl: ["head-ib"])["MASTER_ADDR"] == "head-ib"
    given = slurm_env({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}, hostnames=lambda _: None)
    assert (given["MASTER_ADDR"], given["MASTER_PORT"]) == ("10.0.0.1", "29400")
    # the step's task count, not the allocation's, is the world
    assert slurm_env({**SRUN, "SLURM_NTASKS": "16"}, hostnames=lambda _: None)["WORLD_SIZE"] == "8"
    older = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")}
    assert slurm_env(older, hostnames=lambda _: None)["WORLD_SIZE"] == "8"


@pytest.mark.parametrize("env", [
    {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"},  # the batch script itself, not an srun task
    {**SRUN, "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0"},  # srun torchrun: torchrun's variables
    {**SRUN, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"},  # one task
    {},
])
def test_not_an_srun_distributed_task(env):
    assert slurm_env(env, hostnames=lambda _: None) == {}


def test_restarts_count_torchrun_and_slurm():
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_count({"SLURM_RESTART_COUNT": "1"}) == 1


def test_launch_derives_a_stable_run_dir_and_resumes_only_restarts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torchrun = {"TORCHELASTIC_RUN_ID": "vit-b16", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    t = apply_launch(build_config().train, "digits-vit-tiny", environ=torchrun)
    assert (t.run_dir, t.resume) == (str(Path("runs") / "digits-vit-tiny-vit-b16"), "none")
    slurm = apply_launch(build_config().train, "digits-vit-tiny", environ={**SRUN, **torchrun})
    assert slurm.run_dir == str(Path("runs") / "digits-vit-tiny-slurm123456")
    # a restart resumes only a run directory that exists (one killed before creating it starts over)
    restarted = {**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert apply_launch(build_config().train, "digits-vit-tiny", environ=restarted).resume == "none"
    (tmp_path / "runs" / "digits-vit-tiny-vit-b16").mkdir(parents=True)
    assert apply_launch(build_config().train, "digits-vit-tiny", environ=restarted).resume == "auto"
    # the ranks agree: a rank whose own agent did not count the restart resumes too
    assert apply_launch(build_config().train, "digits-vit-tiny", any_rank=lambda flag: True, environ=torchrun).resume == "auto"
    explicit = apply_launch(build_config(overrides=["train.resume=none", "train.run_dir=x"]).train, "digits-vit-tiny", environ={})
    assert (explicit.run_dir, explicit.resume) == ("x", "none")  # no launcher: unchanged
    assert apply_launch(build_config().train, "digits-vit-tiny", environ={}).run_dir is None


def test_max_restarts_without_rdzv_id_needs_a_run_dir():
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(ConfigError, match="train.run_dir is required under torchrun --max-restarts"):
        apply_launch(build_config().train, "digits-vit-tiny", environ=env)
    assert apply_launch(build_config(overrides=["train.run_dir=r"]).train, "digits-vit-tiny", environ=env).run_dir == "r"


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT raising KeyboardInterrupt, as Python sets it up in a foreground process: a shell's
    background job (``pytest ... &`` in a script) inherits SIGINT ignored, and the handler
    :class:`Preemption` restores for a second request would then ignore it too."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_exit_codes_and_repeated_signals(sigint_as_in_a_terminal):
    assert (exit_code("SIGTERM"), exit_code("SIGINT"), exit_code("SIGUSR1")) == (143, 130, 138)
    stop = Preemption(environ={"TORCHELASTIC_RUN_ID": "x"})
    with stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # a launcher's second copy: ignored, the process lives
    assert stop.name == "SIGTERM"
    plain = Preemption(environ={})
    with plain:
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)  # SIGUSR1 never escalates (its default would kill)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # in a plain process another request acts as usual
    assert plain.name == "SIGUSR1"


def test_a_process_that_ignores_sigint_keeps_ignoring_a_second_one():
    """Started with SIGINT ignored (a background job): the first request still checkpoints and
    stops; a second is handed back to the ignoring disposition, so the process is not killed."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = Preemption(environ={})
        with plain:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # ignored, as the launcher asked: no KeyboardInterrupt
        assert plain.name == "SIGINT" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
