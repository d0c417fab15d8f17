"""Metrics from counts and scores: single-label (:mod:`.classification`: per-class precision /
recall / F1, balanced accuracy, calibration) and multi-label (:mod:`.multilabel`: average
precision, mAP, F1 at a threshold)."""
