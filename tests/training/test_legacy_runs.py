"""Runs written by older vitflow, continued and read by today's (tests/fixtures, see each set's README):
a ViT and a Swin run folder interrupted after their step-3 checkpoint.

- ``legacy/`` (commit 892fe07): before the per-family model sections, its config and ``model_args``
  the old flat 25-key ``model`` section;
- ``before-rooms/`` (commit 800b1ba): before the training layer moved from ``vitflow.train`` to
  ``vitflow.training`` and got sub-packages.

``vitflow resume`` continues each to step 6 bit-identically to the old code's own resume (the final
weights' SHA-256 and every record), and ``vitflow eval`` / ``predict`` / ``model_from_checkpoint`` on
the old checkpoint give the old code's metrics, predictions and logits exactly. On another CPU or
torch than a set was written with, kernels may round differently: the records are then compared to
1e-4 instead."""

import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.config import SwinConfig, ViTConfig, field_names

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SETS = ("legacy", "before-rooms")
EXPECTED = {name: json.loads((FIXTURES / name / "expected.json").read_text()) for name in SETS}
SECTIONS = {"vit": ViTConfig, "swin": SwinConfig}
MID = "checkpoints/step-00000003.pt"
# the fixtures' writer: its fingerprint of the weights, its records and its fixed input, used here as they were there
_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
made = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(made)
CASES = [(fixture_set, run) for fixture_set in SETS for run in ("vit", "swin")]


ADDED_SINCE = ("token_merge",)  # model keys the sections gained after the fixture runs were written


def same_platform(expected: dict) -> bool:
    """Whether this machine runs the kernels a fixture set was written with (torch, CPU ISA)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = sorted(set(re.findall(made.FLAGS, cpuinfo.read_text()))) if cpuinfo.is_file() else []
    return torch.__version__ == expected["torch"] and flags == expected["cpu_flags"]


def assert_same(got, want, exact: bool):
    assert got == want if exact else got == pytest.approx(want, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("fixture_set, name", CASES)
def test_an_old_run_resumes_bit_identically(fixture_set, name, tmp_path, capsys, caplog):
    expected, exact, section = EXPECTED[fixture_set]["runs"][name], same_platform(EXPECTED[fixture_set]), SECTIONS[name]
    run = shutil.copytree(FIXTURES / fixture_set / f"{name}-run", tmp_path / "run")
    old_model = ckpt.load_checkpoint(run / MID)["config"]["model"]
    if fixture_set == "legacy":
        assert len(old_model) == 25 and "distilled" in old_model  # the old flat section, as written then
    else:  # as written then: the section's keys but those added since (absent, their defaults change nothing)
        assert list(old_model) == [k for k in field_names(section) if k not in ADDED_SINCE]
    with caplog.at_level(logging.INFO, logger="vitflow"):
        assert main(["resume", str(run)]) == 0
    capsys.readouterr()
    assert "resumed from" in caplog.text and "changed config" not in caplog.text  # old defaults are no change
    final = ckpt.load_checkpoint(run / "checkpoints" / "step-00000006.pt")
    got = made.records(run)
    summary = next(r for r in got if r["kind"] == "summary")
    assert summary["test_top1_ci95"][0] <= summary["test_top1"] <= summary["test_top1_ci95"][1]
    got = [{k: v for k, v in r.items() if not k.endswith("_ci95")} for r in got]  # intervals came after the fixtures
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in expected["resumed_records"]]
    for a, b in zip(got, expected["resumed_records"]):
        assert a.keys() == b.keys()
        assert_same([a[k] for k in sorted(a) if isinstance(a[k], float)], [b[k] for k in sorted(b)
                                                                           if isinstance(b[k], float)], exact)
    if exact:
        assert made.weights_sha256(final["model"]) == expected["resumed_sha256"]
        assert got == expected["resumed_records"]
    # what the resumed run saved is the family's own section now
    assert list(final["config"]["model"]) == field_names(section)


@pytest.mark.parametrize("fixture_set, name", CASES)
def test_eval_predict_and_logits_of_an_old_checkpoint(fixture_set, name, capsys, tmp_path):
    expected, exact = EXPECTED[fixture_set]["runs"][name], same_platform(EXPECTED[fixture_set])
    run = shutil.copytree(FIXTURES / fixture_set / f"{name}-run", tmp_path / "run")  # eval records into the run
    mid = str(run / MID)
    assert main(["eval", mid, "--json", "-q"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert_same({k: metrics[k] for k in expected["eval"]}, expected["eval"], exact)
    assert main(["predict", mid, str(FIXTURES / fixture_set / "images"), "--json", "-q", "--topk", "3"]) == 0
    predictions = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    for p in predictions:
        p["path"] = Path(p["path"]).name
    assert [[t["class"] for t in p["top"]] for p in predictions] == [
        [t["class"] for t in p["top"]] for p in expected["predictions"]]
    assert_same([t["prob"] for p in predictions for t in p["top"]],
                [t["prob"] for p in expected["predictions"] for t in p["top"]], exact)
    x = made.fixed_input(expected["logits_input_side"])
    with torch.no_grad():
        logits = ckpt.model_from_checkpoint(ckpt.load_checkpoint(mid))(x).flatten().tolist()
    assert_same(logits, [float.fromhex(v) for v in expected["logits"]], exact)
