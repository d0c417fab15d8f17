"""Metrics: the metric table (:mod:`.table`: every figure of an evaluation declared once, read by
evaluation, checkpoint selection, early stopping, summaries, the report and ``vitflow sweep``), and
the computations behind the built-in figures from counts and scores: single-label
(:mod:`.classification`: per-class precision / recall / F1, balanced accuracy, calibration) and
multi-label (:mod:`.multilabel`: average precision, mAP, F1 at a threshold).

Imports nothing of vitflow's other parts."""

from vitflow.metrics.table import (
    METRICS,
    TASKS,
    Accumulator,
    Metric,
    canonical_key,
    headline,
    headline_metrics,
    interval_figures,
    interval_names,
    lookup,
    meaningful,
    primary_metric,
    register_metric,
    selectable_names,
    split_metric,
    summary_names,
    task_of,
)

__all__ = ["METRICS", "TASKS", "Accumulator", "Metric", "canonical_key", "headline", "headline_metrics",
           "interval_figures", "interval_names", "lookup",
           "meaningful", "primary_metric", "register_metric", "selectable_names", "split_metric", "summary_names", "task_of"]
