"""``vitflow inspect`` from Python (:func:`inspect`): what a dataset holds that a figure should not
trust (label issues, leaks and copies, outliers, broken files; :mod:`vitflow.quality`).

With ``model`` (a run, checkpoint, hub folder or weights) the label issues come from linear probes
cross-validated on its embeddings. Without one, ``folds`` models are trained inside ``time_budget``
(k-fold cross-validation with the plan's recipe: each model trained on the other folds scores its
own fold, as in Northcutt et al. 2021's out-of-sample probabilities), and the first of them embeds
the images for copies and outliers.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitflow.config import DataConfig, build_config, parse_duration
from vitflow.data import eval_loader, model_input
from vitflow.data.fixes import image_key
from vitflow.data.sources.base import ImageSource
from vitflow.infer.features.backbone import Backbone, load_backbone
from vitflow.quality.inspection import check_output, inspect_data, open_splits

log = logging.getLogger(__name__)
FOLDS = 2  # k of the k-fold path: each model sees half the training images and half the time
TRAIN_SHARE = 0.8  # of the time budget for the k-fold training; the rest scans and scores
MIN_FOLD_S = 15.0  # seconds a fold trains at least, whatever the budget


def inspect(data: str | os.PathLike, model: str | os.PathLike | None = None, time_budget: str | float = "5m",
            out: str | os.PathLike | None = None, folds: int = FOLDS, seed: int = 0, workers: int = 2,
            label_cut: float | None = None, **overrides: Any):
    """Inspect the images at ``data`` (any source vitflow trains on) and write what it finds.

    Args:
        data: a path (``data.path``): class folders, a tar, a label file, a dataset, a URL.
        model: a run directory, checkpoint, hub folder or ``hf-hub:`` name whose embeddings find
            copies and outliers and feed the label probes; ``None``: k-fold training.
        time_budget: the k-fold path's wall-clock budget (``"5m"``, seconds).
        out: the output folder (default ``inspect-<data name>``): ``index.html``, ``findings.csv``,
            ``findings.json``, ``exclude.txt``, ``relabel.csv``, ``summary.json``. An existing folder
            that is not an earlier inspect's is refused.
        folds: k of the k-fold path (at least 2).
        label_cut: a training image that confident learning flags goes to ``exclude.txt`` when the
            out-of-sample probability of its given class is below this (0 < P <= 1); default half the
            uniform probability (0.5 / classes: the surest); 1 drops every one flagged (confident
            learning's own estimate of the noisy labels; the others are for review).
        overrides: ``data.*`` keys (``data__train_split="train"``, ``data__label_column=...``).
    Returns:
        a pandas DataFrame of findings (:data:`vitflow.quality.findings.COLUMNS`); ``df.attrs`` holds
        ``summary`` and ``files``.
    Raises:
        DataError: no images, one class, unreadable data; FileExistsError: ``out`` is someone
        else's folder; ValueError: ``folds`` < 2, ``label_cut`` outside (0, 1], a bad ``time_budget``, an
        unusable ``model``.
    """
    if folds < 2:
        raise ValueError(f"folds={folds}: k-fold needs at least 2")
    if label_cut is not None and not 0 < label_cut <= 1:
        raise ValueError(f"label_cut={label_cut}: a probability in (0, 1]")
    data_keys = [f"data.{k.removeprefix('data__').removeprefix('data.')}={v}" for k, v in overrides.items()]
    fresh = [f"data.path={data}", "data.source=auto", "data.train_split=train", "data.val_split=auto",
             "data.test_split=auto"]  # the data's own splits, not a preset's
    dcfg = build_config(overrides=[*fresh, *data_keys]).data
    out = Path(out) if out else Path(f"inspect-{Path(str(data).rstrip('/')).stem or 'data'}")
    check_output(out)
    sources = open_splits(dcfg)
    if model is not None:
        backbone = load_backbone(model)
        _say_mismatch(backbone, sources[0][1])
        run_dir = Path(model) if Path(model).is_dir() else None
        cache = run_dir / "inspect-cache" if run_dir is not None and (run_dir / "checkpoints").is_dir() else None
        df, summary, files = inspect_data(dcfg, out, backbone, cache_dir=cache, workers=workers, sources=sources,
                                          extra={"labels": "linear probes cross-validated on the model's embeddings"},
                                          label_cut=label_cut)
    else:
        budget = parse_duration(time_budget)
        probs, backbone, extra = kfold_probabilities(dcfg, sources, out, folds, budget, seed, data_keys)
        df, summary, files = inspect_data(dcfg, out, backbone, probs=probs, workers=workers, extra=extra,
                                          sources=sources, label_cut=label_cut)
    df.attrs.update(summary=summary, files=files)
    return df


def _say_mismatch(backbone: Backbone, train: ImageSource) -> None:
    """One line when ``--model`` was trained on other classes than ``train``'s: its features are used as a
    frozen backbone."""
    if backbone.classes is None:
        return
    if list(backbone.classes) != list(train.classes):
        log.warning("--model %s was trained on %d other classes (%s ...), not this data's %d (%s ...): its embeddings "
                    "are used as a frozen backbone", backbone.source, len(backbone.classes),
                    ", ".join(backbone.classes[:3]), len(train.classes), ", ".join(train.classes[:3]))


def fold_of(labels: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """``int64 (N,)`` the fold of each image: stratified (each class spread evenly), seeded."""
    rng = np.random.default_rng(seed)
    out = np.zeros(len(labels), np.int64)
    for c in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == c))
        out[rows] = (np.arange(len(rows)) + int(rng.integers(folds))) % folds
    return out


@torch.no_grad()
def class_probabilities(backbone: Backbone, source: ImageSource, batch_size: int = 128) -> np.ndarray:
    """``float32 (N, C)`` softmax of ``backbone``'s head over ``source`` in order; an image that cannot
    be read gets uniform probabilities."""
    pp, model = backbone.preprocess, backbone.model.eval()
    n_classes = len(backbone.classes or [])
    out = np.full((len(source), n_classes), 1 / max(n_classes, 1), np.float32)
    for b, batch in enumerate(eval_loader(source, pp, batch_size, 0)):
        bad = {name for name, _ in batch["bad"]}
        rows = [i for i in range(b * batch_size, min((b + 1) * batch_size, len(source))) if source.name(i) not in bad]
        if rows:
            x = model_input(batch["images"], pp.mean, pp.std, torch.device("cpu"))
            out[rows] = model(x).float().softmax(-1).numpy()
    return out


def kfold_probabilities(dcfg: DataConfig, sources: list[tuple[str, ImageSource]], out: Path, folds: int,
                        budget_s: float, seed: int = 0, data_overrides: list[str] = ()
                        ) -> tuple[dict[str, np.ndarray], Backbone, dict]:
    """Out-of-fold class probabilities of the training split (and, averaged over the fold models,
    of the other splits) from ``folds`` runs of ``vitflow train`` on the data, each with one fold
    excluded (``data.exclude``) and ``TRAIN_SHARE * budget_s / folds`` seconds. ``sources``: the
    splits :func:`~vitflow.quality.inspection.open_splits` opened for ``dcfg``; ``data_overrides``
    (``data.KEY=VALUE``) reach each run.

    Returns:
        ``(split -> float32 (N, C), the first fold's model, summary lines)``.
    """
    from vitflow.api.run import train

    t0 = time.perf_counter()
    train_name, train_src = sources[0]
    fold = fold_of(np.asarray(train_src.labels), folds, seed)
    keys = [image_key(train_src, i) for i in range(len(train_src))]
    work = out / "kfold"
    work.mkdir(parents=True, exist_ok=True)
    probs = {name: np.zeros((len(src), len(train_src.classes)), np.float32) for name, src in sources}
    first = None
    for f in range(folds):
        left = max(MIN_FOLD_S, (TRAIN_SHARE * budget_s - (time.perf_counter() - t0)) / (folds - f))
        exclude = work / f"fold-{f}.exclude.txt"
        exclude.write_text("".join(f"{k}\n" for k, g in zip(keys, fold) if g == f), encoding="utf-8",
                           errors="surrogateescape")
        run = train(data=str(dcfg.path), **{**dict(o.split("=", 1) for o in data_overrides),
                                            "data.exclude": str(exclude), "data.train_split": dcfg.train_split,
                                            "train.time_budget": f"{int(left)}s", "train.race": "none",
                                            "train.seed": seed + f, "train.run_dir": str(work / f"fold-{f}")})
        bb = load_backbone(run.folder)
        held = np.flatnonzero(fold == f)
        probs[train_name][held] = class_probabilities(bb, train_src.subset(held))
        for name, src in sources[1:]:
            probs[name] += class_probabilities(bb, src) / folds
        first = first or bb
        log.info("k-fold: fold %d of %d trained in %.0f s", f + 1, folds, left)
    extra = {"labels": f"{folds}-fold training with the plan's recipe ({budget_s:.0f} s budget; runs in {work})",
             "kfold_seconds": round(time.perf_counter() - t0, 1)}
    return probs, first, extra
