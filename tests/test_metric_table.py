"""The metric table: the summary lines it writes, its look-ups and refusals, and a toy metric added
with one declaration that works end to end (evaluation, eval.json, the run summary and summary
line, ``train.keep_best``, the report, ``vitflow sweep``'s direction)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import digits_config
from vitflow.metrics import (
    METRICS,
    Accumulator,
    Metric,
    canonical_key,
    headline,
    register_metric,
    selectable_names,
    split_metric,
    summary_names,
    task_of,
)

FAST = ("train.batch_size=32", "optim.warmup_steps=2", "train.total_steps=16", "train.eval_every=4",
        "optim.lr=0.02", "train.tensorboard=false", "train.live_report=false",
        "data.train_split=train[:80%]", "data.val_split=train[80%:90%]", "data.test_split=train[90%:]")


def _top2_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1).sum().reshape(1)


@pytest.fixture
def declared():
    """Declare ``metrics`` (one register_metric call each) for one test, and remove them after."""
    added = []

    def declare(*metrics: Metric) -> None:
        added.extend(register_metric(m).name for m in metrics)
    yield declare
    for name in added:
        METRICS.pop(name)


def test_summary_lines_keep_their_format():
    r = {"top1": 0.9777, "top5": 1.0, "loss": 0.15281, "macro_f1": 0.9772, "balanced_accuracy": 0.9763, "ece": 0.09512}
    assert headline(r) == "top-1 97.77%  top-5 100.00%  loss 0.1528  macro-F1 97.72%  balanced 97.63%  ECE 0.0951"
    assert headline({"top1": 0.5, "top5": 0.75, "loss": 2.0}) == "top-1 50.00%  top-5 75.00%  loss 2.0000"
    ml = {"map": 0.812, "micro_f1": 0.75, "macro_f1": 0.7, "threshold": 0.35, "loss": 0.1234, "micro_recall": 0.6}
    assert task_of(ml) == "multilabel" and task_of(r) == "multiclass"
    assert headline(ml) == "mAP 81.20%  micro-F1 75.00%  macro-F1 70.00% (threshold 0.35)  loss 0.1234"


def test_lookups_and_what_the_table_lists():
    assert split_metric("val_macro_f1")[0] == "val" and split_metric("val_macro_f1")[1].name == "macro_f1"
    assert split_metric("minival_f1")[1].name == "macro_f1" and canonical_key("val_f1") == "val_macro_f1"
    assert split_metric("raw_test_top1")[0] == "raw_test" and split_metric("top1") is None
    assert split_metric("val_accuracy") is None and canonical_key("val_accuracy") == "val_accuracy"
    assert selectable_names()[:7] == ["top1", "top5", "loss", "map", "micro_f1", "macro_f1", "f1"]
    assert "threshold" not in selectable_names() and "threshold" in summary_names()  # a figure, not a score
    assert {m.name for m in METRICS.values() if m.better == "min"} == {"loss", "ece"}
    assert METRICS["ece"].text(0.09512) == "0.0951" and METRICS["top5"].text(1.0) == "100.00%"


def test_register_metric_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="'top1' is taken"):
        register_metric(Metric("top1", "top-1 again"))
    with pytest.raises(ValueError, match="'f1' is taken \\(by macro_f1\\)"):
        register_metric(Metric("my_f1", "F1", aliases=("f1",)))
    with pytest.raises(ValueError, match="use lower-case"):
        register_metric(Metric("Top-2", "top-2"))
    with pytest.raises(ValueError, match="task 'detection'"):
        register_metric(Metric("box_ap", "box AP", tasks=("detection",)))
    with pytest.raises(ValueError, match="update without compute"):
        register_metric(Metric("top2", "top-2", update=_top2_hits))
    with pytest.raises(ValueError, match="summary-line place for 'multilabel'"):
        register_metric(Metric("top2", "top-2", compute=lambda r: 0.0, summary_line={"multilabel": 9}))
    assert "top2" not in METRICS and "box_ap" not in METRICS


def test_a_metric_from_the_confusion_matrix_in_evaluate(declared, tmp_path):
    """error_rate = 1 - trace / sum of the confusion matrix: equal to 1 - top-1 on a real pass; a
    lower-is-better metric makes `vitflow sweep` minimize."""
    from vitflow.data import eval_loader, open_datasets
    from vitflow.evaluation import evaluate
    from vitflow.models import create_model
    from vitflow.runtime import resolve_precision
    from vitflow.training.sweep import default_direction

    declared(Metric("error_rate", "error rate", better="min",
                    compute=lambda r: 1 - np.trace(r["confusion"]) / r["confusion"].sum()))
    cfg = digits_config(tmp_path)
    data = open_datasets(cfg.data, 8)
    torch.manual_seed(0)
    model = create_model(cfg.model.name, num_classes=len(data.classes))
    loader = eval_loader(data.test.subset(np.arange(100)), data.preprocess, 50, 0)
    cpu = torch.device("cpu")
    r = evaluate(model, loader, cpu, resolve_precision("fp32", cpu), data.preprocess)
    assert r["error_rate"] == pytest.approx(1 - r["top1"], abs=1e-12) and 0 < r["error_rate"] < 1
    assert [k for k in r if not k.endswith("_ci95")][-1] == "error_rate" and Accumulator("multilabel").metrics == []  # a multiclass metric
    assert default_direction("val_error_rate") == "minimize" and default_direction("val_top1") == "maximize"
    assert default_direction("val_ece") == "minimize" and default_direction("val_something") == "maximize"


def _top2_reference(run, split: str) -> float:
    """Top-2 of the run's final weights on ``split``, computed here with a sort."""
    from vitflow import checkpoint as ckpt
    from vitflow.data import eval_loader, model_input, open_datasets

    state = ckpt.load_checkpoint(run)
    model = ckpt.model_from_checkpoint(state).eval()
    data = open_datasets(digits_config(run, *FAST).data, 8)
    hits = n = 0
    with torch.no_grad():
        for b in eval_loader(getattr(data, split), data.preprocess, 64, 0):
            logits = model(model_input(b["images"], data.preprocess.mean, data.preprocess.std, torch.device("cpu")))
            hits += int((logits.argsort(dim=1, descending=True)[:, :2] == b["labels"][:, None]).any(dim=1).sum())
            n += len(b["labels"])
    return hits / n


def test_a_toy_metric_declared_once_works_end_to_end(declared, tmp_path, capsys):
    """top-2 accuracy, summed per batch from the logits: one declaration, then it is in eval.json,
    the metric records, the run summary and the summary line, chooses best.pt as
    train.keep_best=val_top2, and the report shows it."""
    from vitflow import checkpoint as ckpt
    from vitflow.rundir import read_metrics
    from vitflow.training.loop import Trainer
    from vitflow.viz.report import write_report

    declared(Metric("top2", "top-2", update=_top2_hits, compute=lambda r: float(r["sums"][0]) / r["images"],
                    summary_line={"multiclass": 6}))
    run = tmp_path / "run"
    summary = Trainer(digits_config(run, *FAST, "train.keep_best=val_top2", "train.keep_checkpoints=1",
                                    "train.checkpoint_every=4")).fit()
    out = capsys.readouterr().out

    ev = json.loads((run / "eval.json").read_text())  # the final test evaluation
    assert ev["split"] == "test" and ev["top2"] == pytest.approx(_top2_reference(run, "test"), abs=1e-12)
    assert ev["top1"] <= ev["top2"] <= ev["top5"] and summary["test_top2"] == ev["top2"]
    evals = [r for r in read_metrics(run) if r["kind"] == "eval" and r["split"] == "val"]
    values = [r["top2"] for r in evals]
    assert len(values) == 4 and all(0 < v <= 1 for v in values)
    best_step = evals[values.index(max(values))]["step"]  # the first maximum: a tie keeps the earlier
    best = ckpt.load_checkpoint(run / "checkpoints" / "best.pt")
    assert best["step"] == best_step == summary["best_step"] and summary["best_metric"] == "val_top2"
    assert summary["best_value"] == pytest.approx(max(values), abs=1e-6)  # records keep 6 digits
    assert summary["val_top2"] == pytest.approx(values[-1], abs=1e-6)
    assert f"ECE {evals[-1]['ece']:.4f}  top-2 {values[-1]:.2%}" in out  # the summary line, after the others
    assert f"test top-1 {summary['test_top1']:.2%}" in f"test {headline(ev)}"

    page = write_report(run).read_text()
    assert f"<div>val top-2<b>{summary['val_top2']:.2%}</b></div>" in page  # a headline box
    assert f"<tr><td>test_top2</td><td class=num>{summary['test_top2']:.2%}</td></tr>" in page  # final metrics
