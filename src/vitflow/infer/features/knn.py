"""Weighted k-nearest-neighbour classification of frozen features, as DINO reports it.

A backbone is judged without training a head: every query image's pooled feature is compared by
cosine similarity (dot product of L2-normalised features) with a memory bank of labelled training
features; its ``k`` most similar training images vote for their classes, each with the weight
``exp(sim / T)`` (``T = 0.07``), and the class with the largest summed weight is the prediction.

References: Wu et al. 2018, "Unsupervised Feature Learning via Non-Parametric Instance
Discrimination" (the weighted vote, section 3.4); Caron et al. 2021, "Emerging Properties in
Self-Supervised Vision Transformers" (DINO), whose ``eval_knn.py`` (``knn_classifier``) is the
reference implementation this module follows (``k = 20``, ``T = 0.07``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TEMPERATURE = 0.07  # DINO's eval_knn.py default (its --temperature)


@torch.no_grad()
def knn_scores(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int = 20,
               temperature: float = TEMPERATURE, num_classes: int | None = None, chunk: int = 1024) -> torch.Tensor:
    """The summed vote of each query's ``k`` nearest bank features, per class.

    Args:
        bank: ``float (N, D)`` features of the labelled (training) images; L2-normalised here.
        bank_labels: ``int64 (N,)`` class indices of ``bank``.
        queries: ``float (Q, D)`` features to classify; L2-normalised here.
        k: neighbours per query (capped at ``N``).
        temperature: ``T`` of the weights ``exp(cosine / T)``.
        num_classes: ``C`` (default: ``max(bank_labels) + 1``).
        chunk: queries compared at once (bounds memory to ``chunk x N`` similarities).
    Returns:
        ``float32 (Q, C)``: for each query and class, the sum of ``exp(sim / T)`` over the query's
        ``k`` nearest bank images of that class (``argmax`` is the prediction).
    Raises:
        ValueError: an empty bank, ``k < 1``, feature widths that differ, or labels that do not
        fit ``bank``.
    """
    if len(bank) == 0 or k < 1:
        raise ValueError(f"k-NN needs a non-empty memory bank and k >= 1 (got {len(bank)} features, k={k})")
    if bank.shape[1] != queries.shape[1] or bank_labels.shape != (len(bank),):
        raise ValueError(f"k-NN: bank {tuple(bank.shape)}, labels {tuple(bank_labels.shape)} and queries "
                         f"{tuple(queries.shape)} do not fit together")
    c = int(num_classes or int(bank_labels.max()) + 1)
    k = min(k, len(bank))
    bank = F.normalize(bank.float(), dim=1)
    labels = bank_labels.long()
    out = []
    for q in F.normalize(queries.float(), dim=1).split(chunk):
        sim, idx = (q @ bank.T).topk(k, dim=1)  # (q, k) cosine similarities of the k nearest
        weights = (sim / temperature).exp()
        votes = torch.zeros(len(q), c, dtype=torch.float32)
        out.append(votes.scatter_add_(1, labels[idx], weights))
    return torch.cat(out) if out else torch.zeros(0, c)


def knn_top1(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, query_labels: torch.Tensor,
             k: int = 20, temperature: float = TEMPERATURE, num_classes: int | None = None) -> float:
    """Fraction of ``queries`` whose :func:`knn_scores` argmax is their label ``int64 (Q,)``.

    Raises:
        ValueError: as :func:`knn_scores`, or no query.
    """
    if len(queries) == 0:
        raise ValueError("k-NN: no query features to score")
    scores = knn_scores(bank, bank_labels, queries, k, temperature, num_classes)
    return float((scores.argmax(dim=1) == query_labels.long()).double().mean())
