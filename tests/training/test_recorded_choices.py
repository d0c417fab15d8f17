"""The choices made by timing (vitflow.timing): kept in checkpoints and repeated by a resume even
where a new timing would choose otherwise (bit-identical to the uninterrupted run), made again with
``--retime`` (said so); cached per machine, so that a new run does not time again; rank 0's on
every rank."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

from helpers import ENV, digits_config
from vitflow import checkpoint as ckpt
from vitflow import timing
from vitflow.cli import main
from vitflow.models.attention import auto as auto_mod
from vitflow.training import Trainer

COMMON = ["model.attention=auto", "train.precision=fp32", "train.checkpoint_every=2", "train.eval_every=0",
          "train.log_every=1", "train.live_report=false"]


def _prefer(monkeypatch, name: str) -> None:
    """attention=auto's timing finds ``name`` the fastest (as a busier or quieter machine might)."""
    monkeypatch.setattr(auto_mod, "fastest", lambda calls, *a, **k: {n: 1.0 if n == name else 2.0 for n in calls})
    auto_mod.clear_choices()  # a new process


def _timed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention=auto:")]


def test_a_resume_repeats_the_recorded_choices_bit_for_bit_and_retime_makes_them_again(tmp_path, monkeypatch,
                                                                                        caplog, capsys):
    _prefer(monkeypatch, "sdpa")
    Trainer(digits_config(tmp_path / "full", "train.total_steps=4", *COMMON)).fit()
    _prefer(monkeypatch, "sdpa")
    part = tmp_path / "part"
    Trainer(digits_config(part, "train.total_steps=2", *COMMON)).fit()
    recorded = ckpt.load_checkpoint(part)["choices"]["attention"]
    n = len(recorded)
    assert n >= 2 and set(recorded.values()) == {"sdpa"}  # training and evaluation inputs
    _prefer(monkeypatch, "math")  # the resumed process would choose otherwise
    with caplog.at_level(logging.INFO):
        Trainer(digits_config(part, "train.total_steps=4", "train.resume=auto", *COMMON)).fit()
    a, b = ckpt.load_checkpoint(tmp_path / "full"), ckpt.load_checkpoint(part)
    assert a["step"] == b["step"] == 4
    for name, tensor in a["model"].items():  # bit for bit: math would round otherwise
        assert torch.equal(tensor, b["model"][name]), name
    assert b["choices"]["attention"] == recorded
    assert f"resuming with the choices made by timing that {ckpt.checkpoint_path(part, 2)} recorded (" in caplog.text
    assert f"attention sdpa x{n}" in caplog.text and _timed(caplog) == []
    _prefer(monkeypatch, "math")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["resume", str(part), "--retime", "train.total_steps=6", *COMMON[:1]]) == 0
    assert "--retime: the choices made by timing are made again, not taken from" in caplog.text
    assert "not promised to be bit-identical to an uninterrupted one" in caplog.text
    assert len(_timed(caplog)) == n and set(ckpt.load_checkpoint(part)["choices"]["attention"].values()) == {"math"}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["resume", str(part), "train.total_steps=7"]) == 0  # --retime was for that start only
    assert f"attention math x{n}" in caplog.text and _timed(caplog) == []


def test_a_second_run_on_the_machine_takes_the_cached_choices_and_times_nothing(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache" / "choices.json"
    monkeypatch.setenv(timing.CACHE_ENV, str(cache))
    _prefer(monkeypatch, "math")
    timing.forget()  # as a new process: earlier tests' choices of the same shapes forgotten
    threads = "train.threads=1"  # the fingerprint holds the thread count: an earlier test may have changed ours
    with caplog.at_level(logging.INFO):
        Trainer(digits_config(tmp_path / "first", "train.total_steps=2", threads, *COMMON)).fit()
    n = len(_timed(caplog))
    data = json.loads(cache.read_text())
    assert data["format"] == "vitflow-choices" and data["version"] == timing.CACHE_VERSION
    mine = data["machines"][timing.machine_fingerprint()]["choices"]
    assert set(mine["attention"].values()) == {"math"} and len(mine["attention"]) == n >= 2
    second = tmp_path / "second"  # a new process on the same machine
    out = subprocess.run([sys.executable, "-m", "vitflow", "train", f"train.run_dir={second}", "train.total_steps=2",
                          threads, *COMMON], env={**ENV, timing.CACHE_ENV: str(cache)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "choices made by timing: reusing an earlier run's on this machine" in out.stderr
    assert "attention=auto:" not in out.stderr  # nothing timed
    assert ckpt.load_checkpoint(second)["choices"]["attention"] == ckpt.load_checkpoint(tmp_path / "first")[
        "choices"]["attention"]
    _prefer(monkeypatch, "sdpa")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--retime", f"train.run_dir={tmp_path / 'third'}", "train.total_steps=2", threads,
                         *COMMON]) == 0
    assert len(_timed(caplog)) == n  # timed again, the cache refreshed
    assert set(json.loads(cache.read_text())["machines"][timing.machine_fingerprint()]["choices"]["attention"]
               .values()) == {"sdpa"}


def test_choices_are_recorded_cached_adopted_and_agreed(tmp_path, monkeypatch):
    monkeypatch.setenv(timing.CACHE_ENV, str(tmp_path / "c.json"))
    calls = []

    def timer(value):
        return lambda: calls.append(value) or value

    key = ((8, 16), torch.float32, "cpu")
    timing.forget("test")
    assert timing.choose("test", key, timer("a")) == "a" and timing.choose("test", key, timer("b")) == "a"
    assert calls == ["a"] and timing.recorded()["test"] == {str(key): "a"}
    timing.forget("test")
    assert timing.choose("test", key, timer("b")) == "a" and calls == ["a"]  # from the cache
    timing.forget("test")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)  # another thread count: another fingerprint
    assert timing.choose("test", key, timer("c")) == "c"
    monkeypatch.undo()
    monkeypatch.setenv(timing.CACHE_ENV, str(tmp_path / "c.json"))
    timing.forget("test")
    timing.adopt({"test": {str(key): "z"}})  # a resumed checkpoint's wins over the cache
    assert timing.choose("test", key, timer("d")) == "z"
    timing.forget("test")
    timing.set_retime(True)
    try:
        assert timing.choose("test", key, timer("e")) == "e"  # the cache not read
    finally:
        timing.set_retime(False)
    timing.forget("test")
    timing.set_agreement(lambda value: "rank0s")
    try:
        assert timing.choose("test", ("other",), timer("mine")) == "rank0s"
        with timing.local_choices():
            assert timing.choose("test", ("local",), timer("mine")) == "mine"
    finally:
        timing.set_agreement(None)
        timing.forget("test")
    assert calls == ["a", "c", "e", "mine", "mine"]


def test_a_choice_timed_on_a_busy_machine_is_used_and_recorded_but_not_cached(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "c.json"
    monkeypatch.setenv(timing.CACHE_ENV, str(cache))
    now = [0.0]  # a clock each call advances by its scripted seconds (warm-up round first)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def timer(a: tuple, b: tuple):
        def call(rounds):
            it = iter(rounds)
            return lambda: now.__setitem__(0, now[0] + next(it))

        def time_it() -> str:
            best = timing.fastest({"a": call(a), "b": call(b)}, 3)
            return min(best, key=best.get)
        return time_it

    timing.forget()
    steady = (0.003,) * 4
    with caplog.at_level(logging.INFO, logger="vitflow.timing"):  # b's rounds 2, 9, 2 ms: another process's load
        assert timing.choose("test", ("busy",), timer(steady, (0.01, 0.002, 0.009, 0.002))) == "b"
    assert "not cached, the machine looked busy (rounds of b 350% over 20% apart)" in caplog.text
    assert timing.recorded()["test"] == {"('busy',)": "b"}  # used and recorded (a checkpoint keeps it)
    assert not cache.exists()
    assert timing.choose("test", ("quiet",), timer(steady, (0.002, 0.0021, 0.002, 0.0022))) == "b"
    assert json.loads(cache.read_text())["machines"][timing.machine_fingerprint()]["choices"] == {
        "test": {"('quiet',)": "b"}}
    # rounds 1.0, 1.6, 1.0 ms spread 60%, but every one beats a's 3 ms: no load flipped this choice
    assert timing.choose("test", ("clear",), timer(steady, (0.001, 0.001, 0.0016, 0.001))) == "b"
    timing.forget()  # a new process: the busy choice is timed again, the quiet one comes from the cache
    assert timing.choose("test", ("busy",), timer(steady, (0.004,) * 4)) == "a"
    assert timing.choose("test", ("quiet",), timer(steady, (0.004,) * 4)) == "b"
    sub_ms = (0.0001, 0.0001, 0.0004, 0.0001)  # jitter of sub-millisecond calls is no sign of a busy machine
    assert timing.choose("test", ("short",), timer((0.0002,) * 4, sub_ms)) == "b"
    assert json.loads(cache.read_text())["machines"][timing.machine_fingerprint()]["choices"]["test"] == {
        "('quiet',)": "b", "('clear',)": "b", "('busy',)": "a", "('short',)": "b"}
    timing.forget()


@pytest.mark.parametrize("value", ["off", "0"])
def test_the_cache_can_be_turned_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(timing.CACHE_ENV, value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timing.forget("test")
    assert timing.cache_path() is None and timing.choose("test", ("k",), lambda: "x") == "x"
    timing.forget("test")
    assert list(tmp_path.iterdir()) == []

