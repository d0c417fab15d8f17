"""Frozen features: ``vitflow embed`` (pooled features of image files, folders and tars, written
as ``.npy`` with their paths) and ``vitflow eval --knn`` (k-NN top-1 of a backbone's features,
:mod:`vitflow.infer.features.knn`).

The feature of an image is the model's pooled representation before the classifier,
``forward_head(forward_features(x), pre_logits=True)``: the class token, the mean of the patch
tokens (with token merging, each merged token weighed by the patches it holds) or the
attention-pooled (MAP) token, as the model pools; ``float32 (D,)``. Images go
through the model's saved evaluation preprocessing, as in ``vitflow predict`` and ``vitflow eval``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vitflow.config import build_config
from vitflow.data import SkipReport, eval_loader, model_input, open_split
from vitflow.data import check_config as check_data_config
from vitflow.data.sources.dispatch import scored_split
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.infer.features.backbone import Backbone, load_backbone
from vitflow.infer.features.knn import TEMPERATURE, knn_top1
from vitflow.infer.predict import ImageRef, decoded_batches
from vitflow.models import config_class
from vitflow.runtime import resolve_device

log = logging.getLogger(__name__)

PATHS_SUFFIX = ".paths.txt"


@torch.no_grad()
def pooled_features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``float (B, 3, S, S)`` normalised images -> pooled features ``float32 (B, D)`` on the CPU: the
    input of the model's classifier (a ViT's merged tokens weighed by the patches each holds, as its
    own head pools them: :meth:`~vitflow.models.vit.model.VisionTransformer.forward_tokens`)."""
    if hasattr(model, "forward_tokens"):
        tokens, sizes = model.forward_tokens(x)
        return model.forward_head(tokens, pre_logits=True, sizes=sizes).float().cpu()
    return model.forward_head(model.forward_features(x), pre_logits=True).float().cpu()


def embed_images(backbone: Backbone, refs: Sequence[ImageRef], batch_size: int = 32, workers: int = 2,
                 device: str = "auto") -> tuple[np.ndarray, list[str]]:
    """Pooled features of ``refs`` (from :func:`vitflow.infer.collect_images`), in input order.

    An image that cannot be read or decoded is skipped with one warning naming it.

    Returns:
        ``(features float32 (N, D), paths)``: ``N`` the images embedded, ``paths[i]`` the name of
        row ``i`` (a file path, or ``archive.tar:member``).
    Raises:
        ValueError: no image could be read.
    """
    dev = resolve_device(device)
    model = backbone.model.to(dev).eval()
    pp = backbone.preprocess
    feats, paths = [], []
    for chunk, decoded in decoded_batches(list(refs), eval_transform(pp), batch_size, workers):
        ok = []
        for ref, d in zip(chunk, decoded):
            if isinstance(d, str):
                log.warning("skipped %s: %s", ref.name, d)
            else:
                ok.append(d)
                paths.append(ref.name)
        if ok:
            feats.append(pooled_features(model, model_input(torch.stack(ok), pp.mean, pp.std, dev)))
    if not feats:
        raise ValueError(f"none of the {len(refs)} image(s) could be read; see the warnings above")
    return torch.cat(feats).numpy().astype(np.float32, copy=False), paths


def paths_file(features_path: str | Path) -> Path:
    """The paths file beside a features file: ``features.npy`` -> ``features.paths.txt``."""
    p = Path(features_path)
    return p.with_name(p.name.removesuffix(".npy") + PATHS_SUFFIX)


def write_features(features: np.ndarray, paths: Sequence[str], out: str | Path) -> dict[str, str]:
    """Write ``features`` ``(N, D)`` as ``out`` (``.npy``) and ``paths`` beside it, one per line in
    the same order (UTF-8; a newline inside a name is written as ``\\n``). Both are written to
    temporary files first and renamed, so a reader never sees half a file.

    Load them with ``np.load("features.npy")`` and
    ``open("features.paths.txt", encoding="utf-8").read().splitlines()``.

    Returns:
        ``{"features": path, "paths": path}``.
    Raises:
        ValueError: ``out`` does not end in ``.npy``, or rows and paths differ in number.
    """
    out = Path(out)
    if out.suffix != ".npy":
        raise ValueError(f"-o {out}: the features file must end in .npy")
    if len(features) != len(paths):
        raise ValueError(f"{len(features)} feature rows for {len(paths)} paths")
    out.parent.mkdir(parents=True, exist_ok=True)
    names = paths_file(out)
    tmp_f, tmp_p = out.with_name(f".{out.name}.tmp"), names.with_name(f".{names.name}.tmp")
    with open(tmp_f, "wb") as f:
        np.save(f, np.ascontiguousarray(features, dtype=np.float32))
    lines = [p.replace("\n", "\\n") for p in paths]
    tmp_p.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8", errors="surrogateescape")
    os.replace(tmp_f, out)
    os.replace(tmp_p, names)
    return {"features": str(out), "paths": str(names)}


@torch.no_grad()
def split_features(model: torch.nn.Module, source, pp: Preprocess, batch_size: int, num_workers: int | str,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pooled features of every readable image of a split (an :class:`~vitflow.data.ImageSource`).

    Returns:
        ``(features float32 (N, D), labels int64 (N,), images skipped as unreadable)``.
    """
    feats, labels, skipped, skips = [], [], 0, SkipReport()
    for batch in eval_loader(source, pp, batch_size, num_workers):
        skipped += len(batch["bad"])
        skips.add(-1, batch["bad"])  # one warning per unreadable image
        if len(batch["labels"]):
            feats.append(pooled_features(model, model_input(batch["images"], pp.mean, pp.std, device)))
            labels.append(batch["labels"].long().cpu())
    if not feats:
        raise ValueError("no readable image in a split of the k-NN data; see the warnings above")
    return torch.cat(feats), torch.cat(labels), skipped


def _knn_data_config(backbone: Backbone, data: str | None, overrides: Sequence[str]):
    """The data section k-NN reads: the run's (``data.path=...`` overrides it) or, for a plain
    backbone, the defaults on ``data`` (its train split, and its test or val split)."""
    fresh = [f"data.path={data}", "data.source=auto", "data.train_split=train", "data.val_split=auto",
             "data.test_split=auto"] if data else []
    if backbone.config is None and not data:
        raise ValueError(f"{backbone.source} carries no data: give --data PATH (images with a train split and a "
                         "test or val split: class folders, a tar, a label file or a dataset)")
    cfg = build_config(base=backbone.config, overrides=[*fresh, *overrides], checks={"data": check_data_config},
                       model_config=config_class)
    if cfg.data.task == "multilabel":
        raise ValueError("--knn scores single-label data (one class per image); this data is data.task=multilabel")
    return cfg.data


def knn_evaluate(spec: str | Path, k: int = 20, data: str | None = None, overrides: Sequence[str] = (),
                 model_name: str | None = None, weights: str = "auto", batch_size: int | None = None,
                 temperature: float = TEMPERATURE, device: str = "auto") -> dict[str, Any]:
    """k-NN top-1 of a backbone's frozen features (:func:`vitflow.infer.features.knn.knn_top1`): the train
    split is the memory bank, the test split (the val split when there is none) the queries.

    Args:
        spec, model_name, weights: the model (:func:`vitflow.infer.features.backbone.load_backbone`).
        data: the images (default: the run's data); its splits are ``train`` and ``test``/``val``.
        overrides: ``data.*`` ``key=value`` overrides (e.g. ``data.test_split=val``).
    Returns:
        ``{"knn_top1", "knn_k", "knn_temperature", "split", "split_expr", "train_split",
        "train_images", "images", "skipped", "feature_dim", "model"}``.
    Raises:
        ValueError: no data for a plain backbone, multi-label data, unreadable splits (DataError).
    """
    bb = load_backbone(spec, model_name, weights)
    dcfg = _knn_data_config(bb, data, overrides)
    dev = resolve_device(device)
    model, pp = bb.model.to(dev).eval(), bb.preprocess
    own_data = bb.config is not None and not data and not any(o.startswith("data.path=") for o in overrides)
    bank_src = open_split(dcfg.path, dcfg.train_split, dcfg.source, classes=bb.classes if own_data else None,
                          cfg=dcfg)  # other data: its own classes (k-NN reads no head)
    role, split = scored_split(dcfg)
    query_src = open_split(dcfg.path, split, dcfg.source, classes=list(bank_src.classes), cfg=dcfg)
    bs = batch_size or dcfg.eval_batch_size or 256
    bank, bank_labels, skip_bank = split_features(model, bank_src, pp, bs, dcfg.num_workers, dev)
    queries, query_labels, skip_query = split_features(model, query_src, pp, bs, dcfg.num_workers, dev)
    top1 = knn_top1(bank, bank_labels, queries, query_labels, k, temperature, len(bank_src.classes))
    return {"knn_top1": top1, "knn_k": k, "knn_temperature": temperature, "split": role, "split_expr": split,
            "train_split": dcfg.train_split, "train_images": len(bank), "images": len(queries),
            "skipped": skip_bank + skip_query, "feature_dim": int(bank.shape[1]), "model": bb.source}
