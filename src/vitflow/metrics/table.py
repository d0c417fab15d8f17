"""The metric table: every figure an evaluation reports, declared once as a :class:`Metric` (its
name, label, whether higher or lower is better, its format, the tasks it applies to and how it is
computed) in :data:`METRICS`, and read by everything that names a metric:

- the evaluation passes (:mod:`vitflow.evaluation`) compute the declared metrics that the pass does
  not compute itself (:class:`Accumulator`: a metric's per-batch ``update`` sums and its
  ``compute``);
- ``train.keep_best`` / ``train.early_stopping_metric`` (:mod:`vitflow.training.track.selection`) and the
  default direction of ``vitflow sweep`` (:func:`split_metric`, :attr:`Metric.better`);
- the run summary, the EMA's ``ema_*`` and ``raw_*`` figures (:func:`summary_names`) and the
  one-line summary (:func:`headline`) of training and ``vitflow eval``;
- the run report (:mod:`vitflow.viz.report`: its headline boxes, accuracy panel, final-metrics
  table and their formats).

A new metric is one :func:`register_metric` call (see the "A new metric" paragraph of
docs/architecture.md): for example the top-2 accuracy, summed per batch, distributed-exact::

    register_metric(Metric("top2", "top-2", update=lambda logits, labels: (
        logits.topk(2, dim=1).indices == labels[:, None]).any(dim=1).sum().reshape(1),
        compute=lambda r: r["sums"][0] / r["images"]))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch

from vitflow.metrics.intervals import balanced_accuracy as balanced_of_counts
from vitflow.metrics.intervals import bootstrap_of, wilson_of
from vitflow.metrics.intervals import macro_f1 as macro_f1_of_counts

TASKS = ("multiclass", "multilabel")  # the values of data.task


@dataclass(frozen=True, eq=False)
class Metric:
    """One figure of an evaluation.

    Attributes:
        name: the key in evaluation results, ``eval.json``, metric records and the run summary
            (``val_NAME``, ``test_NAME``), and the METRIC of ``train.keep_best=SPLIT_METRIC``;
            lower-case letters, digits and ``_``.
        label: its name for humans (``top-1``, ``macro-F1``): report boxes and panels.
        better: ``"max"`` or ``"min"`` (which way ``train.keep_best``, early stopping and ``vitflow
            sweep`` go), or ``None`` for a figure that is no score (the multi-label threshold),
            which cannot be selected on.
        format: ``"percent"`` (a fraction shown as ``97.77%``) or ``"number"``; ``digits`` after
            the decimal point.
        tasks: the tasks (``multiclass``, ``multilabel``) whose evaluations have it.
        compute: ``None`` when the evaluation pass computes it itself (loss, top-1, the
            confusion-matrix and calibration figures, mAP ...); else ``compute(inputs) -> float``,
            called once per evaluation after the pass. ``inputs`` holds every figure the pass
            computed (``loss``, ``images`` ...) and, as NumPy arrays, for ``multiclass`` the
            ``confusion`` matrix (``int64 (C, C)``, row: true class) and the ``calibration`` bin
            sums (``int64 (3, M)``), for ``multilabel`` the ``probs`` and ``targets`` (``float64
            (n, C)``) and the ``threshold``; and ``sums``, the metric's ``update`` values summed
            over the batches (and the ranks of a distributed evaluation), when it has ``update``.
        update: ``update(logits, labels) -> tensor`` per batch (``logits (B, C)`` float on the
            model's device, ``labels`` ``int64 (B,)`` or multi-hot ``uint8 (B, C)``); its values
            are summed, so integer counts keep a distributed evaluation exact. Needs ``compute``.
        aliases: other names ``train.keep_best`` accepts (``val_f1`` = ``val_macro_f1``).
        summary: kept in the run summary (``val_NAME``, ``test_NAME``, ``--json``), the report's
            final metrics and the EMA's ``ema_NAME`` / ``raw_NAME`` figures.
        summary_line: its place (0 first) in the one-line summary of each task (:func:`headline`);
            a task it is not listed for does not show it there.
        line: how it reads in that line, ``{}`` standing for the value (default ``"LABEL {}"``);
            text in parentheses qualifies the figure before it and follows it after one space.
        min_classes: the fewest classes for which the figure means something (top-5 needs 6: with
            5 classes or fewer every image's label is among the top 5); an evaluation of fewer
            classes leaves it out (:func:`meaningful`), so no summary, line or report shows it.
        interval: ``interval(inputs) -> (low, high)``, its 95% confidence interval from the
            same inputs as ``compute`` (:mod:`vitflow.metrics.intervals`: ``wilson_of(name)`` for
            a fraction of the images, ``bootstrap_of(statistic)`` for a figure of the per-class
            counts), kept as ``NAME_ci95`` beside the figure (:func:`interval_figures`) and shown
            after it; ``None``: no interval.
    """

    name: str
    label: str
    better: Literal["max", "min"] | None = "max"
    format: Literal["percent", "number"] = "percent"
    digits: int = 2
    tasks: tuple[str, ...] = ("multiclass",)
    compute: Callable[[Mapping[str, Any]], float] | None = None
    update: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    aliases: tuple[str, ...] = ()
    summary: bool = True
    summary_line: Mapping[str, int] = field(default_factory=dict)
    line: str = ""
    min_classes: int = 0
    interval: Callable[[Mapping[str, Any]], tuple[float, float]] | None = None

    def text(self, value: float | None) -> str:
        """``value`` in the metric's format: ``97.77%`` or ``0.1528`` (``n/a`` for ``None``)."""
        if value is None:
            return "n/a"
        return f"{value:.{self.digits}%}" if self.format == "percent" else f"{value:.{self.digits}f}"

    def interval_text(self, interval) -> str:
        """A ``(low, high)`` interval in the metric's format, one digit fewer: ``[96.9-98.4]``
        (percent) or ``[0.121-0.183]``."""
        low, high = interval
        if self.format == "percent":
            return f"[{low * 100:.{max(0, self.digits - 1)}f}-{high * 100:.{max(0, self.digits - 1)}f}]"
        return f"[{low:.{self.digits + 1}f}-{high:.{self.digits + 1}f}]"


METRICS: dict[str, Metric] = {}  # name -> Metric, in the order of registration


def register_metric(metric: Metric) -> Metric:
    """Add ``metric`` to :data:`METRICS` (after the others); returns it.

    Raises:
        ValueError: a name or alias that is taken or not ``[a-z0-9_]``, an unknown task, ``better``
            or ``format``, a summary-line place for a task it does not apply to, or ``update``
            without ``compute``.
    """
    taken = {n for m in METRICS.values() for n in (m.name, *m.aliases)}
    for n in (metric.name, *metric.aliases):
        if not n or not all(c.islower() or c.isdigit() or c == "_" for c in n) or n[0] == "_":
            raise ValueError(f"metric name {n!r}: use lower-case letters, digits and _")
        if n in taken:
            raise ValueError(f"metric name {n!r} is taken (by {lookup(n).name})")
    problems = [f"task {t!r} (one of {', '.join(TASKS)})" for t in metric.tasks if t not in TASKS]
    problems += [f"better={metric.better!r} (max, min or None)"] if metric.better not in ("max", "min", None) else []
    problems += [f"format={metric.format!r} (percent or number)"] if metric.format not in ("percent", "number") else []
    problems += [f"a summary-line place for {t!r}, not among its tasks"
                 for t in metric.summary_line if t not in metric.tasks]
    problems += ["update without compute"] if metric.update and not metric.compute else []
    if not metric.tasks or problems:
        raise ValueError(f"metric {metric.name}: " + ("; ".join(problems) or "no task"))
    METRICS[metric.name] = metric
    return metric


def lookup(name: str) -> Metric | None:
    """The metric called ``name`` (or with that alias), or ``None``."""
    return METRICS.get(name) or next((m for m in METRICS.values() if name in m.aliases), None)


def split_metric(key: str) -> tuple[str, Metric] | None:
    """``"val_macro_f1"`` -> ``("val", METRICS["macro_f1"])``: the metric whose name (or alias)
    is the longest ending of ``key`` after a ``_`` and a non-empty prefix (``raw_val_top1`` ->
    ``raw_val``, top-1); ``None`` when no metric ends ``key``."""
    names = sorted(((n, m) for m in METRICS.values() for n in (m.name, *m.aliases)), key=lambda x: -len(x[0]))
    return next(((key[:-len(n) - 1], m) for n, m in names if key.endswith("_" + n) and len(key) > len(n) + 1), None)


def canonical_key(key: str) -> str:
    """``key`` with an alias replaced by its metric's name (``val_f1`` -> ``val_macro_f1``)."""
    found = split_metric(key)
    return f"{found[0]}_{found[1].name}" if found else key


def selectable_names() -> list[str]:
    """What ``train.keep_best`` may name after its split: the names and aliases of the metrics
    with a direction, in table order."""
    return [n for m in METRICS.values() if m.better for n in (m.name, *m.aliases)]


def summary_names() -> tuple[str, ...]:
    """The names of the metrics kept in run summaries (:attr:`Metric.summary`)."""
    return tuple(m.name for m in METRICS.values() if m.summary)


CI = "_ci95"  # the suffix of a figure's 95% interval: top1 -> top1_ci95


def interval_names() -> tuple[str, ...]:
    """The keys of the intervals kept in run summaries beside their figures (``top1_ci95`` ...)."""
    return tuple(m.name + CI for m in METRICS.values() if m.summary and m.interval is not None)


def interval_figures(inputs: Mapping[str, Any], task: str) -> dict[str, list[float]]:
    """``{NAME_ci95: [low, high]}`` of each metric of ``task`` with an :attr:`Metric.interval`
    whose figure ``inputs`` holds (``inputs``: as :attr:`Metric.compute` gets them)."""
    return {m.name + CI: [float(x) for x in m.interval(inputs)] for m in METRICS.values()
            if m.interval is not None and task in m.tasks and inputs.get(m.name) is not None}


def meaningful(result: dict[str, Any], classes: int) -> dict[str, Any]:
    """``result`` (an evaluation's figures, by metric name) without the metrics that mean nothing
    for ``classes`` classes (:attr:`Metric.min_classes`: top-5 of a 2-class model is always 100%)."""
    return {k: v for k, v in result.items() if k not in METRICS or METRICS[k].min_classes <= classes}


def headline_metrics(task: str) -> list[Metric]:
    """The metrics of ``task``'s one-line summary, in their order."""
    return sorted((m for m in METRICS.values() if task in m.summary_line), key=lambda m: m.summary_line[task])


def task_of(result: Mapping[str, Any]) -> str:
    """The task of an evaluation's figures: the first of :data:`TASKS` whose first headline metric
    they hold (``multiclass`` when none)."""
    return next((t for t in TASKS if (first := headline_metrics(t)) and first[0].name in result), TASKS[0])


def primary_metric(task: str) -> Metric:
    """The first figure of ``task``'s one-line summary: top-1, or mAP for multi-label data."""
    return headline_metrics(task)[0]


def headline(result: Mapping[str, Any], task: str | None = None) -> str:
    """The figures of an evaluation for one line, e.g. ``top-1 97.77% [96.9-98.4]  top-5 100.00%
    [99.6-100.0]  loss 0.1528  macro-F1 97.72% [96.8-98.5]  balanced 97.63% [96.7-98.4]  ECE
    0.0951`` or, for multi-label, ``mAP 81.20%  micro-F1 75.00%  macro-F1 70.00% (threshold 0.35)
    loss 0.1234``: the task's headline metrics that ``result`` holds (``task``: default
    :func:`task_of`), each followed by its 95% interval where ``result`` has one (``NAME_ci95``)."""
    parts: list[str] = []
    for m in headline_metrics(task or task_of(result)):
        if result.get(m.name) is None:
            continue
        value = m.text(result[m.name])
        if result.get(m.name + CI):
            value += " " + m.interval_text(result[m.name + CI])
        text = (m.line or m.label + " {}").format(value)
        if text.startswith("(") and parts:
            parts[-1] += " " + text
        else:
            parts.append(text)
    return "  ".join(parts)


class Accumulator:
    """The declared metrics of ``task`` that the evaluation pass does not compute itself: their
    per-batch ``update`` sums and, after the pass, their ``compute``.

    Use: :meth:`add` per batch, :meth:`reduce` for a distributed evaluation, then
    :meth:`results`. With no such metric (the built-in table) each call does nothing.
    """

    def __init__(self, task: str):
        self.metrics = [m for m in METRICS.values() if task in m.tasks and m.compute is not None]
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch: ``logits (B, C)``, ``labels`` as the pass has them (see :attr:`Metric.update`)."""
        for m in self.metrics:
            if m.update is not None:
                value = m.update(logits, labels.to(logits.device, non_blocking=True))
                self.sums[m.name] = value if m.name not in self.sums else self.sums[m.name] + value

    def reduce(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the per-batch sums over the ranks with ``fn`` (e.g. ``DistEnv.all_reduce_sum``)."""
        self.sums = {k: fn(v) for k, v in self.sums.items()}

    def results(self, inputs: Mapping[str, Any]) -> dict[str, float]:
        """``{name: float}`` of each metric's ``compute`` over ``inputs`` (see :attr:`Metric.compute`)."""
        out = {}
        for m in self.metrics:
            sums = self.sums.get(m.name)
            arrays = {"sums": sums.detach().cpu().numpy()} if sums is not None else {}
            out[m.name] = float(m.compute({**inputs, **arrays}))
        return out


_MC, _ML, _BOTH = ("multiclass",), ("multilabel",), ("multiclass", "multilabel")
for _m in (
    Metric("top1", "top-1", summary_line={"multiclass": 0}, interval=wilson_of("top1")),
    Metric("top5", "top-5", summary_line={"multiclass": 1}, min_classes=6, interval=wilson_of("top5")),
    Metric("loss", "loss", "min", "number", 4, _BOTH, summary_line={"multiclass": 2, "multilabel": 4}),
    Metric("map", "mAP", tasks=_ML, summary_line={"multilabel": 0}),
    Metric("micro_f1", "micro-F1", tasks=_ML, summary_line={"multilabel": 1}),
    Metric("macro_f1", "macro-F1", tasks=_BOTH, aliases=("f1",), summary_line={"multiclass": 3, "multilabel": 2},
           interval=bootstrap_of(macro_f1_of_counts)),
    Metric("weighted_f1", "weighted F1"),
    Metric("macro_precision", "macro precision"),
    Metric("macro_recall", "macro recall"),
    Metric("weighted_precision", "weighted precision", summary=False),
    Metric("weighted_recall", "weighted recall", summary=False),
    Metric("micro_precision", "micro precision", tasks=_ML, summary=False),
    Metric("micro_recall", "micro recall", tasks=_ML, summary=False),
    Metric("balanced_accuracy", "balanced accuracy", summary_line={"multiclass": 4}, line="balanced {}",
           interval=bootstrap_of(balanced_of_counts)),
    Metric("ece", "ECE", "min", "number", 4, summary_line={"multiclass": 5}),
    Metric("threshold", "threshold", None, "number", 2, _ML, summary_line={"multilabel": 3}, line="(threshold {})"),
):
    register_metric(_m)
