"""Precision and device resolution: precision=auto on a CPU and its GEMM probe."""

import pytest
import torch


@pytest.mark.parametrize("native, gflops, expected", [
    (True, {"fp32": 340.0, "bf16": 190.0}, "fp32"),  # AVX512-BF16 without AMX (this machine): bf16 is slower
    (True, {"fp32": 340.0, "bf16": 1500.0}, "bf16"),  # AMX
    (False, {"fp32": 340.0, "bf16": 1500.0}, "fp32"),  # no native bf16 kernels
])
def test_precision_auto_on_a_cpu_takes_bf16_only_where_its_gemm_is_faster(monkeypatch, caplog, native, gflops,
                                                                            expected):
    from vitflow import runtime as amp
    from vitflow import timing

    timing.forget("precision")  # the process's recorded choice (another case's) would be taken again
    monkeypatch.setattr(amp, "cpu_bf16_supported", lambda: native)
    monkeypatch.setattr(amp, "cpu_gemm_gflops", lambda: gflops)
    with caplog.at_level("INFO", logger="vitflow"):
        p = amp.resolve_precision("auto", torch.device("cpu"))
    assert p.name == expected and p.dtype == {"fp32": None, "bf16": torch.bfloat16}[expected]
    assert amp.resolve_precision("bf16", torch.device("cpu")).name == "bf16"  # an explicit choice stays
    if native:  # the choice is logged with both figures
        assert f"precision auto: {expected} (this CPU's GEMM: bf16 {gflops['bf16']:.0f} GFLOP/s" in caplog.text


def test_cpu_gemm_probe_measures_both_gemms_and_leaves_the_rng_alone():
    from vitflow import runtime as amp

    amp.cpu_gemm_gflops.cache_clear()
    state = torch.get_rng_state()
    g = amp.cpu_gemm_gflops()
    assert torch.equal(torch.get_rng_state(), state)
    assert set(g) == {"fp32", "bf16"} and all(0.0 < v < 1e6 for v in g.values())  # bf16 emulated: ~1 GFLOP/s
    assert amp.cpu_gemm_gflops() is g  # measured once per process


def test_settled_heap_freezes_the_objects_alive_on_entry_and_gives_them_back():
    import gc

    from vitflow.runtime import settled_heap

    kept = [[] for _ in range(1000)]  # alive on entry (lists: tracked by the collector): frozen
    with settled_heap():
        assert gc.get_freeze_count() >= 1000
        assert not any(o is kept[0] for o in gc.get_objects(2))  # out of the oldest generation's walks
    assert gc.get_freeze_count() == 0  # a later run's collections see them again
    assert any(o is kept[0] for o in gc.get_objects(2))


def test_a_run_without_threads_gets_the_count_back_that_an_earlier_run_changed():
    from vitflow.runtime import use_threads

    default = torch.get_num_threads()
    try:
        assert use_threads(None) == default
        assert use_threads(1) == 1 and torch.get_num_threads() == 1  # a run with train.threads=1
        assert use_threads(None) == default and torch.get_num_threads() == default  # the next run, without
        use_threads(1)
        torch.set_num_threads(3)  # the user's own choice in between is kept
        assert use_threads(None) == 3
    finally:
        torch.set_num_threads(default)


def test_a_small_alternate_signal_stack_is_replaced_by_a_roomy_one():
    import ctypes

    from vitflow.runtime import ALT_STACK_BYTES, _StackT, ensure_signal_stack

    libc = ctypes.CDLL(None, use_errno=True)
    small = ctypes.create_string_buffer(20144)  # what a library left in the suite
    assert libc.sigaltstack(ctypes.byref(_StackT(ctypes.cast(small, ctypes.c_void_p), 0, 20144)), None) == 0
    assert ensure_signal_stack() is True
    now = _StackT()
    libc.sigaltstack(None, ctypes.byref(now))
    assert (now.ss_size, now.ss_flags) == (ALT_STACK_BYTES, 0)
    assert ensure_signal_stack() is False  # roomy already
