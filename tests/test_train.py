import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import encode, make_folder
from vitflow.cli import main
from vitflow.config import build_config
from vitflow.train import Trainer
from vitflow.train import checkpoint as ckpt
from vitflow.train.logging import read_metrics
from vitflow.train.optim import param_groups
from vitflow.train.schedules import Schedule

ROOT = Path(__file__).resolve().parents[1]


def tiny(run_dir, *extra):
    return build_config(overrides=[f"train.run_dir={run_dir}", "train.log_every=5", *extra])


def test_digits_run_learns_and_writes_run_dir(digits_run):
    run, r, _ = digits_run
    assert Path(r["checkpoint"]).name == "step-00000400.pt"
    recs = read_metrics(run / "metrics.jsonl")
    evals = [x for x in recs if x["kind"] == "eval"]
    assert [e["step"] for e in evals] == [200, 400]
    assert evals[-1]["top1"] == pytest.approx(r["test_top1"]) and evals[-1]["top1"] > evals[0]["top1"]
    trains = [x for x in recs if x["kind"] == "train"]
    assert len(trains) == 16 and trains[0]["loss"] > trains[-1]["loss"] + 0.5
    assert all(0 <= x["data_stall"] <= 1 and x["images_per_s"] > 0 for x in trains)
    # 1438 training images give 11 full batches of 128 an epoch: 400 steps = epochs 0..35 and 4 batches of 36
    epochs = [x for x in recs if x["kind"] == "epoch"]
    assert [x["epoch"] for x in epochs] == list(range(37)) and [x.get("partial") for x in epochs[-2:]] == [None, True]
    assert epochs[-1]["step"] == 400 and epochs[-1]["batches"] == 4
    assert sum(x["skipped_images"] for x in epochs) == r["skipped_images"] == 0
    assert (run / "config.yaml").read_text().count("vit_digits_patch2_8") == 1
    assert len(list((run / "samples").glob("*.png"))) == 10


def test_every_epoch_gets_its_record_when_one_step_spans_several(tmp_path):
    """1,438 digits training images, micro-batches of 1,024: one batch an epoch, and each step's two
    micro-batches end two epochs. Every epoch gets its record after the step that ended it."""
    run = tmp_path / "run"
    Trainer(tiny(run, "train.batch_size=2048", "train.accum_steps=2", "train.total_steps=2",
                 "optim.warmup_steps=0")).fit()
    epochs = [(x["epoch"], x["step"]) for x in read_metrics(run / "metrics.jsonl") if x["kind"] == "epoch"]
    assert epochs == [(0, 1), (1, 1), (2, 2), (3, 2)]


def test_resume_past_total_steps_is_refused_and_leaves_the_run_untouched(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    files = {p: p.read_bytes() for p in [run / "config.yaml", run / "eval.json", Path(r["checkpoint"])]}
    assert main(["train", f"train.resume={r['checkpoint']}", "train.total_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: train.resume: {r['checkpoint']} is at step 400, past train.total_steps=2; "
                   "raise train.total_steps to train on (vitflow eval evaluates it)")
    assert all(p.read_bytes() == data for p, data in files.items())


@pytest.mark.parametrize("max_in_memory", [0, 1000], ids=["files", "ram_cache"])
def test_unreadable_images_counted_per_split_and_same_in_eval_json_and_vitflow_eval(tmp_path, caplog, capsys,
                                                                                  max_in_memory):
    """A bad train image counts in every training epoch, a bad test image in every evaluation and
    never in an epoch; eval.json, the summary and `vitflow eval` agree, with or without the RAM cache."""
    data = make_folder(tmp_path / "data", per_class=5, split="train")
    make_folder(tmp_path / "data", per_class=3, split="test", seed=1)
    (data / "train" / "a" / "truncated.jpg").write_bytes(encode(np.zeros((8, 8, 3), np.uint8), "JPEG")[:40])
    (data / "test" / "b" / "empty.jpg").write_bytes(b"")  # 16 train images (2 batches of 8), 10 test
    run = tmp_path / "run"
    cfg = tiny(run, f"data.path={data}", "data.source=folder", "data.train_split=train", "data.test_split=test",
               f"data.max_in_memory={max_in_memory}", "model.image_size=8", "train.batch_size=8",
               "train.total_steps=6", "train.eval_every=3", "optim.warmup_steps=2")
    with caplog.at_level("WARNING"):
        r = Trainer(cfg).fit()
    assert (r["skipped_images"], r["test_skipped"]) == (3, 1)  # 3 epochs x 1 train file; 1 test file
    recs = read_metrics(run / "metrics.jsonl")
    epochs = [(x["epoch"], x["step"], x["skipped_images"]) for x in recs if x["kind"] == "epoch"]
    assert epochs == [(0, 2, 1), (1, 4, 1), (2, 6, 1)]  # the run ends with epoch 2: it has its record
    assert [(x["step"], x["skipped"], x["images"]) for x in recs if x["kind"] == "eval"] == [(3, 1, 9), (6, 1, 9)]
    assert json.loads((run / "eval.json").read_text())["skipped"] == 1
    warned = [m.getMessage() for m in caplog.records if "unreadable image" in m.getMessage()]
    assert sum(str(data / "train" / "a" / "truncated.jpg") in m for m in warned) == 1  # once, in all epochs
    assert sum(str(data / "test" / "b" / "empty.jpg") in m for m in warned) == 1  # once, in all evaluations
    caplog.clear()
    capsys.readouterr()
    with caplog.at_level("WARNING"):
        assert main(["eval", r["checkpoint"], "--json"]) == 0
    captured = capsys.readouterr()
    ev = json.loads(captured.out.strip().splitlines()[-1])
    assert (ev["test_skipped"], ev["test_images"]) == (1, 9) and "skipped 1 unreadable image(s)" in captured.err
    assert any(str(data / "test" / "b" / "empty.jpg") in m.getMessage() for m in caplog.records)


def test_param_groups_exclude_norms_biases_pos_and_cls():
    from vitflow import create_model

    m = create_model("vit_cifar_patch4_32", num_classes=10)
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.bias"} <= nd
    assert all(p.ndim >= 2 for p in decay["params"]) and "pos_embed" not in {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def test_warmup_cosine_values():
    f = Schedule(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert Schedule(100, 0, "linear")(50) == pytest.approx(0.5)


def test_accumulation_equals_one_large_batch(tmp_path):
    """4 micro-batches of 8 then one step == one batch of 32 (fp32, no dropout): 1e-5."""
    params = []
    for accum in (1, 4):
        cfg = tiny(tmp_path / f"acc{accum}", "train.batch_size=32", f"train.accum_steps={accum}",
                   "train.label_smoothing=0.1", "data.train_augment=none")  # augmentation draws are per batch
        tr = Trainer(cfg)
        it = iter(tr.loader)
        batches = [tr.next_batch(it) for _ in range(accum)]
        if accum == 1:
            ref_images = batches[0]["images"]
        else:
            assert torch.equal(torch.cat([b["images"] for b in batches]), ref_images)
        tr.train_step(batches)
        params.append(torch.cat([p.detach().flatten() for p in tr.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], atol=1e-5, rtol=0)


def test_checkpoint_write_killed_midway_keeps_previous(tmp_path, monkeypatch):
    path1 = ckpt.save_checkpoint({"step": 1, "model": {"w": torch.ones(3)}}, ckpt.checkpoint_path(tmp_path, 1))

    def dying_save(obj, f, *a, **k):
        f.write(b"partial")
        raise KeyboardInterrupt  # the process is interrupted while writing

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint({"step": 2}, ckpt.checkpoint_path(tmp_path, 2))
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path) == [path1]
    assert ckpt.load_checkpoint(tmp_path)["step"] == 1
    truncated = tmp_path / "checkpoints" / "step-00000003.pt"
    truncated.write_bytes(path1.read_bytes()[:100])
    with pytest.raises(ValueError, match="step-00000003.pt"):
        ckpt.load_checkpoint(truncated)


def _train_cmd(run_dir, data, steps, *extra):
    return [sys.executable, "-m", "vitflow", "train", f"data.path={data}", "data.source=folder",
            "data.train_split=train[:75%]", "data.test_split=train[75%:]", "data.num_workers=2", "data.hflip=true",
            "model.image_size=8", "model.drop_path_rate=0.1", "model.drop_rate=0.1", "train.batch_size=8",
            f"train.total_steps={steps}", f"train.run_dir={run_dir}", "train.keep_checkpoints=100",
            "train.precision=fp32", "train.threads=1", *extra]


def test_sigkill_then_resume_matches_uninterrupted_run_bitwise(tmp_path):
    """A real SIGKILL after step k, resume, step 2k: identical parameters (CPU, same thread count:
    bitwise, because batches, augmentations, dropout and the optimizer state are all restored)."""
    data = make_folder(tmp_path / "data", per_class=16, size=12)
    k, env = 6, {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = tmp_path / "full"
    subprocess.run(_train_cmd(full, data, 2 * k, f"train.checkpoint_every={k}"), check=True, env=env,
                   capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(killed, data, 2 * k, f"train.checkpoint_every={k}"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not ckpt.list_checkpoints(killed) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    first = ckpt.list_checkpoints(killed)
    assert first and ckpt.load_checkpoint(first[0])["step"] == k
    for p in first[1:]:  # anything written after step k would also be complete: drop it to resume at k
        p.unlink()
    subprocess.run(_train_cmd(killed, data, 2 * k, "train.resume=auto", f"train.checkpoint_every={k}"), check=True,
                   env=env, capture_output=True)
    a = ckpt.load_checkpoint(ckpt.checkpoint_path(full, 2 * k))
    b = ckpt.load_checkpoint(ckpt.checkpoint_path(killed, 2 * k))
    assert a["step"] == b["step"] == 2 * k
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["data"]["position"] == b["data"]["position"]
    changed = ckpt.load_checkpoint(ckpt.checkpoint_path(full, k))["model"]["head.weight"]
    assert not torch.equal(changed, a["model"]["head.weight"])  # training did move the weights


def test_resume_rejects_other_classes(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny(run, "train.total_steps=2")).fit()
    data = make_folder(tmp_path / "data", per_class=4)
    cfg = build_config(overrides=[f"train.run_dir={run}", "train.resume=auto", f"data.path={data}",
                                  "data.source=folder", "data.train_split=train[:50%]",
                                  "data.test_split=train[50%:]"])
    with pytest.raises(ValueError, match="classes"):
        Trainer(cfg)


def test_progressive_resizing_schedule_and_run(tmp_path):
    from vitflow.data.augment import progressive_resolution

    sizes = [progressive_resolution(s, 100, 16, 32, (0.2, 0.6), 4) for s in range(0, 101, 10)]
    assert sizes == [16, 16, 16, 20, 24, 28, 32, 32, 32, 32, 32]
    assert progressive_resolution(0, 10, 3, 8, (0.0, 1.0), 2) == 2  # rounded to the patch size, never below it
    run = tmp_path / "run"
    cfg = tiny(run, "train.total_steps=40", "data.progressive_min_size=4", "data.progressive_ramp=[0.25,0.75]")
    tr = Trainer(cfg)
    costs = [tr._step_cost(s, 40) for s in (0, 20, 39)]
    assert costs == [4 / 16, 9 / 16, 1.0]  # 2x2, 3x3 and 4x4 patch grids of the 8 px digits (avg pool)
    r = tr.fit()
    res = [x["resolution"] for x in read_metrics(run / "metrics.jsonl") if x["kind"] == "train"]
    assert res == sorted(res) and res[0] == 4 and res[-1] == 8
    assert 0 <= r["test_top1"] <= 1


def test_resume_warns_about_changed_config(caplog):
    from vitflow.train.loop import _warn_config_changes

    saved = build_config(overrides=["train.run_dir=a"]).to_dict()
    with caplog.at_level("WARNING", logger="vitflow.train.loop"):
        _warn_config_changes(saved, build_config(overrides=["train.run_dir=b", "train.resume=auto"]), Path("c.pt"))
        assert not caplog.records  # where the run lives is not a change of what it trains
        _warn_config_changes(saved, build_config(overrides=["train.batch_size=64", "optim.lr=0.5"]), Path("c.pt"))
    msg = caplog.records[-1].getMessage()
    assert "c.pt" in msg and "optim.lr 0.003 -> 0.5" in msg and "train.batch_size 128 -> 64" in msg
    assert "run_dir" not in msg


def test_warmup_longer_than_the_run_is_warned(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="vitflow.train.loop"):
        Trainer(tiny(tmp_path / "a", "train.total_steps=20", "optim.warmup_steps=10"))
        assert not caplog.records
        Trainer(tiny(tmp_path / "b", "train.total_steps=20", "optim.warmup_steps=40"))
    msg = caplog.records[-1].getMessage()
    assert "optim.warmup_steps=40" in msg and "train.total_steps (20 steps)" in msg and "0.5 of the peak lr" in msg


@pytest.mark.parametrize("native, gflops, expected", [
    (True, {"fp32": 340.0, "bf16": 190.0}, "fp32"),  # AVX512-BF16 without AMX (this machine): bf16 is slower
    (True, {"fp32": 340.0, "bf16": 1500.0}, "bf16"),  # AMX
    (False, {"fp32": 340.0, "bf16": 1500.0}, "fp32"),  # no native bf16 kernels
])
def test_precision_auto_on_a_cpu_takes_bf16_only_where_its_gemm_is_faster(monkeypatch, caplog, native, gflops,
                                                                            expected):
    from vitflow.train import amp

    monkeypatch.setattr(amp, "cpu_bf16_supported", lambda: native)
    monkeypatch.setattr(amp, "cpu_gemm_gflops", lambda: gflops)
    with caplog.at_level("INFO", logger="vitflow"):
        p = amp.resolve_precision("auto", torch.device("cpu"))
    assert p.name == expected and p.dtype == {"fp32": None, "bf16": torch.bfloat16}[expected]
    assert amp.resolve_precision("bf16", torch.device("cpu")).name == "bf16"  # an explicit choice stays
    if native:  # the choice is logged with both figures
        assert f"precision auto: {expected} (this CPU's GEMM: bf16 {gflops['bf16']:.0f} GFLOP/s" in caplog.text


def test_cpu_gemm_probe_measures_both_gemms_and_leaves_the_rng_alone():
    from vitflow.train import amp

    amp.cpu_gemm_gflops.cache_clear()
    state = torch.get_rng_state()
    g = amp.cpu_gemm_gflops()
    assert torch.equal(torch.get_rng_state(), state)
    assert set(g) == {"fp32", "bf16"} and all(1.0 < v < 1e6 for v in g.values())
    assert amp.cpu_gemm_gflops() is g  # measured once per process
