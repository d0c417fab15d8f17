"""keep_best through checkpoint rotation, early stopping (and its exact resume), named evaluation
splits and the live report, on short runs of the embedded digits."""

from __future__ import annotations

import signal

import pytest

from helpers import digits_config
from vitflow import checkpoint as ckpt
from vitflow.config import ConfigError, build_config
from vitflow.rundir import read_metrics
from vitflow.training.callbacks import LiveReport
from vitflow.training.loop import Trainer
from vitflow.training.run.preempt import Preemption
from vitflow.training.track.selection import Selection, check_config

FAST = ("train.batch_size=32", "optim.warmup_steps=2", "train.total_steps=20", "train.eval_every=2",
        "train.tensorboard=false", "train.live_report=false")


def _evals(run, split):
    return [r for r in read_metrics(run) if r["kind"] == "eval" and r["split"] == split]


def test_keep_best_survives_rotation_and_named_evals_are_logged(tmp_path):
    """optim.lr=0.05 makes the accuracy peak early and then fall; with keep_checkpoints=1 the best
    one (chosen on a named split) is kept as best.pt at the step of the logged maximum."""
    from vitflow.viz.report import write_live_report

    seen = []

    def on_eval(run_dir):  # the live report, written after the first evaluation only (matplotlib is slow)
        if not seen:
            seen.append(write_live_report(run_dir).read_text())

    run = tmp_path / "run"
    cfg = digits_config(run, *FAST, "optim.lr=0.02", "train.keep_checkpoints=1", "train.checkpoint_every=2",
                        "data.evals=minival:train[70%:80%],heldout:train[80%:90%]", "train.keep_best=minival_top1")
    summary = Trainer(cfg, [LiveReport(on_eval)]).fit()
    minival = _evals(run, "minival")
    assert len(minival) == 10 and len(_evals(run, "heldout")) == 10  # each named split at each evaluation
    assert all(r["split_expr"] == "train[70%:80%]" for r in minival)
    values = [r["top1"] for r in minival]
    best_step = minival[values.index(max(values))]["step"]  # the first maximum: ties keep the earlier
    assert best_step < 20, values  # it peaked early, so rotation removed its step checkpoint
    best = ckpt.load_checkpoint(run / "checkpoints" / "best.pt")
    assert best["step"] == best_step == summary["best_step"] and summary["best_value"] == pytest.approx(max(values), abs=1e-6)  # logged: 6 digits
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000020.pt"]
    from vitflow.infer.evaluate import evaluate_checkpoint  # eval --checkpoint best scores best.pt

    assert evaluate_checkpoint(ckpt.choose_checkpoint(run, "best"), ["data.test_split=train[70%:80%]"])["step"] == best_step
    assert summary["best_metric"] == "minival_top1" and "early_stopped" not in summary
    # the live report after the first evaluation: the run so far, the P/R/F1 table and the calibration
    assert "Metrics so far" in seen[0] and "figures so far, up to step 2" in seen[0]
    assert "Per-class precision, recall, F1" in seen[0] and 'alt="reliability diagram"' in seen[0]
    assert (run / "report" / "accuracy.png").is_file() and (run / "report" / "reliability.png").is_file()


def _predicted_stop(values, patience, min_delta, eval_every):
    best, bad = None, 0
    for i, v in enumerate(values):
        if best is None or v - best > min_delta:
            best, bad = v, 0
        else:
            bad += 1
        if bad >= patience:
            return (i + 1) * eval_every
    return None


def test_early_stopping_stops_where_predicted_and_a_resumed_run_stops_alike(tmp_path, monkeypatch):
    args = (*FAST, "train.total_steps=40", "optim.lr=0.02", "train.keep_best=test_top1",
            "train.early_stopping_patience=2", "train.early_stopping_min_delta=0.02", "train.checkpoint_every=2")
    full = Trainer(digits_config(tmp_path / "full", *args)).fit()
    values = [r["top1"] for r in _evals(tmp_path / "full", "test")]
    stop = _predicted_stop(values, 2, 0.02, 2)
    assert stop is not None and stop < 40 and full["step"] == stop
    assert full["early_stopped"].startswith(f"early stopping at step {stop}: test_top1 has not improved")
    assert ckpt.load_checkpoint(tmp_path / "full")["step"] == stop

    run = tmp_path / "resumed"
    interrupt_at = stop - 1  # not an evaluation step (eval_every=2): the state goes through the checkpoint
    assert interrupt_at % 2
    original = Trainer.train_step

    def train_step(self, batches):
        out = original(self, batches)
        if self.step == interrupt_at:
            self.callbacks.find(Preemption).signum = signal.SIGTERM
        return out
    monkeypatch.setattr(Trainer, "train_step", train_step)
    assert Trainer(digits_config(run, *args)).fit()["interrupted"] == "SIGTERM"
    monkeypatch.setattr(Trainer, "train_step", original)
    state = ckpt.load_checkpoint(run)
    assert state["step"] == interrupt_at and state["selection"]["bad_evals"] > 0
    resumed = Trainer(digits_config(run, *args, "train.resume=auto")).fit()
    assert resumed["step"] == stop and resumed["early_stopped"] == full["early_stopped"]
    assert [r["top1"] for r in _evals(run, "test")] == values  # each evaluation once, alike


def test_selection_rules_and_refusals():
    s = Selection("val_loss", 2, 0.1, None, ["val"])
    assert s.update(1, {"val": {"loss": 1.0}}) and not s.update(2, {"val": {"loss": 1.0}})  # a tie keeps the first
    assert s.update(3, {"val": {"loss": 0.95}}) and s.bad_evals == 2 and s.stopped  # better, but not by 0.1
    assert Selection("val_f1", 0, 0, None, ["val"]).keep == ("val", "macro_f1", "max")
    assert Selection("val_macro_recall", 0, 0, None, ["val"]).keep == ("val", "macro_recall", "max")
    assert Selection("val_ece", 0, 0, None, ["val"]).keep[2] == "min"
    with pytest.raises(ConfigError, match="'test' is not evaluated during training"):
        Selection("test_top1", 0, 0, None, ["val"])
    with pytest.raises(ConfigError, match=r"train.keep_best='val_accuracy' is not a known metric: .* one of top1, "
                                          r"top5, loss, .*, ece \(e.g. val_top1\) \(in command line\)"):
        build_config(overrides=["train.keep_best=val_accuracy"], checks={"train": check_config})  # the layer's check
    with pytest.raises(ConfigError, match="train.early_stopping_metric='val_threshold' is not a known metric"):
        Selection("val_top1", 2, 0, "val_threshold", ["val"])  # the trainer's own: a figure, not a score
    with pytest.raises(ConfigError, match="train.early_stopping_patience"):
        build_config(overrides=["train.early_stopping_patience=3", "train.eval_every=10"])
    with pytest.raises(ConfigError, match="reserved"):
        from vitflow.data.sources.evals import parse_evals
        parse_evals("val:train[:10%]")
