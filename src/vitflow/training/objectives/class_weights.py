"""Imbalanced classes: per-class loss weights (``train.class_weights``), the line that states them and
the sampler, and the class distribution of each split written for the report.

``balanced`` weights are scikit-learn's ``compute_class_weight("balanced")``:
``w_c = n / (C * count_c)`` (King & Zeng 2001), so that every class carries the same total weight and
the mean weight over the training images is 1 (the loss keeps its scale). They enter the
cross-entropy as ``torch.nn.functional.cross_entropy(weight=w)``: for class-index targets the mean
is ``sum_i w[y_i] * l_i / sum_i w[y_i]``, with label smoothing ``l_i`` is PyTorch's smoothed loss
(the uniform part weighted by ``w`` too); for soft targets (Mixup/CutMix) each class term
``-t_c log p_c`` is scaled by ``w_c`` and the batch mean divides by ``B``. For multi-label BCE the
weights are ``pos_weight`` (``balanced``: negatives / positives of each class).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import torch

from vitflow.config import ConfigError
from vitflow.data.loader import DISTRIBUTION_FILE, class_counts

log = logging.getLogger(__name__)


def balanced_weights(counts: list[int]) -> list[float]:
    """``n / (C * count_c)`` per class (``C`` = ``len(counts)``); ``1.0`` for a class without
    images (it has no term to weigh)."""
    n, c = sum(counts), len(counts)
    return [n / (c * k) if k else 1.0 for k in counts]


def read_weight_file(path: str | Path, classes: list[str]) -> list[float]:
    """Per-class weights from ``path``: JSON (a list of numbers in class order, or ``{class name:
    weight}`` naming every class) or text (one number per line, in class order; blank lines and
    ``#`` comments skipped).

    Raises:
        ConfigError: unreadable file, a value that is not a finite number >= 0, a count other than
            the class count, or unknown / missing class names; the message names the file.
    """
    key, path = "train.class_weights", Path(path)
    try:
        text = path.read_text()
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            if isinstance(data, dict):
                unknown, missing = set(data) - set(classes), [c for c in classes if c not in data]
                if unknown or missing:
                    raise ConfigError(f"{key}: {path} names unknown classes {sorted(unknown)[:5]} / misses "
                                      f"{missing[:5]}", key)
                data = [data[c] for c in classes]
            values = [float(v) for v in data]
        else:
            values = [float(line.split("#")[0]) for line in text.splitlines() if line.split("#")[0].strip()]
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: cannot read {path}: {type(e).__name__}: {e}", key) from None
    if len(values) != len(classes):
        raise ConfigError(f"{key}: {path} has {len(values)} weights for {len(classes)} classes", key)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"{key}: {path} has a weight that is not a finite number >= 0", key)
    return values


def labels_known(labels: np.ndarray) -> bool:
    """False for a split whose labels are read as it streams (WebDataset shards mark them ``-1``)."""
    return not (np.ndim(labels) == 1 and len(labels) and int(np.min(labels)) < 0)


def resolve_class_weights(spec: str, labels: np.ndarray, classes: list[str], task: str = "multiclass"
                          ) -> torch.Tensor | None:
    """``train.class_weights`` as a ``float32 (C,)`` tensor, or ``None`` for ``none``.

    Args:
        labels: the training split's labels, ``int64 (n,)`` or multi-hot ``(n, C)`` (``task="multilabel"``:
            ``balanced`` gives BCE ``pos_weight = (n - P_c) / P_c``, ``1`` for a class without positives).
    Raises:
        ConfigError: see :func:`read_weight_file`.
    """
    if spec == "none":
        return None
    if spec == "balanced" and not labels_known(labels):
        raise ConfigError("train.class_weights=balanced counts the training labels before training, but this data "
                          "streams them (WebDataset shards): give the weights as a FILE", "train.class_weights")
    counts = class_counts(labels, len(classes))
    if spec != "balanced":
        values = read_weight_file(spec, classes)
    elif task == "multilabel":
        n = len(labels)
        values = [(n - p) / p if p else 1.0 for p in counts]
    else:
        values = balanced_weights(counts)
    return torch.tensor(values, dtype=torch.float32)


def apply_class_weights(criterion, weights: torch.Tensor | None, task: str = "multiclass") -> None:
    """Give ``criterion`` (:class:`~vitflow.training.objectives.distill.LabelLoss`, ``MultiLabelLoss`` or the label
    term of ``DistillationLoss``) its ``weight`` / ``pos_weight``. Raises ConfigError for the asymmetric
    loss (it has its own weighting)."""
    if weights is None:
        return
    target = getattr(criterion, "label_loss", criterion)
    if task == "multilabel":
        if getattr(target, "kind", "bce") != "bce":
            raise ConfigError("train.class_weights applies to train.loss=bce (ASL weighs its own terms)",
                              "train.class_weights")
        target.pos_weight = weights
    else:
        target.weight = weights


def setup_imbalance(spec: str, sampler: str, data, criterion, device: torch.device) -> None:
    """Weigh ``criterion`` by ``spec`` (``train.class_weights``; on ``device``) and log one line
    stating the weights and ``sampler`` (``data.sampler``). ``data``: the run's
    :class:`~vitflow.data.pipeline.Datasets`."""
    weights = resolve_class_weights(spec, data.train.labels, data.classes, data.task)
    apply_class_weights(criterion, None if weights is None else weights.to(device), data.task)
    if weights is None and sampler == "random":
        return
    what = "none" if weights is None else (
        f"{spec} ({'pos_weight ' if data.task == 'multilabel' else ''}min {float(weights.min()):.3g}"
        f", max {float(weights.max()):.3g})")
    counts = class_counts(data.train.labels, len(data.classes)) if labels_known(data.train.labels) else None
    log.info("imbalanced data: class weights %s; sampler %s; training images per class %s", what, sampler,
             f"{min(counts)} to {max(counts)}" if counts else "not known before reading (streamed shards)")
    if weights is not None and sampler == "balanced":
        log.warning("train.class_weights and data.sampler=balanced both correct the imbalance: together they "
                    "over-weight the rare classes")


def write_distribution(run_dir: str | Path, data) -> Path:
    """Write ``RUN_DIR/class_counts.json``: ``{"classes": [...], "splits": {"train": {"split": expr,
    "counts": [...], "images": N, "digest": D}, "val": ..., "test": ...}}`` (images per class;
    positives for multi-label; what the expression selected:
    :func:`~vitflow.data.sources.splits.selection_record`), which the report shows
    (:mod:`vitflow.viz.distribution`). Returns the path."""
    splits = {}
    for role, source, expr in (("train", data.train, None), ("val", data.val, data.val_split),
                               ("test", data.test, data.test_split)):
        if source is not None and labels_known(source.labels):  # streamed shards: known only once read
            splits[role] = {"split": expr, "counts": class_counts(source.labels, len(data.classes)),
                            **data.selection.get(role, {})}
    path = Path(run_dir) / DISTRIBUTION_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"classes": list(data.classes), "splits": splits}))
    tmp.replace(path)
    return path
