"""Nearest neighbours of embeddings by cosine similarity (faiss ``IndexFlatIP`` over L2-normalised
rows: exact k-NN in ``O(N k)`` memory, no ``N x N`` matrix; Johnson et al. 2019, "Billion-scale
similarity search with GPUs")."""

from __future__ import annotations

import logging

import numpy as np


def faiss():
    """The faiss module, its loader's notes on which CPU build it found kept out of INFO logs."""
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    import faiss as module

    return module


def normalized(x: np.ndarray) -> np.ndarray:
    """``float32 (N, D)`` rows scaled to unit L2 norm (zero rows stay zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosine_knn(queries: np.ndarray, bank: np.ndarray, k: int, same: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most similar ``bank`` rows of each query.

    Args:
        queries, bank: ``float32 (Q, D)``, ``(N, D)`` features (normalised here).
        same: ``queries`` is ``bank``: each row's own match is left out.
    Returns:
        ``(similarity float32 (Q, k'), index int64 (Q, k'))``, most similar first, ``k' = min(k, N - same)``;
        ``index`` is ``-1`` where there are fewer neighbours.
    """
    q, b = normalized(queries), normalized(bank)
    kk = min(k + int(same), len(b))
    if kk <= 0 or not len(q):
        return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64)
    index = faiss().IndexFlatIP(b.shape[1])
    index.add(b)
    sim, nn = index.search(q, kk)
    if same:  # drop each row's own match (wherever ties put it)
        own = nn == np.arange(len(q))[:, None]
        own[~own.any(1), -1] = True
        sim = sim[~own].reshape(len(q), kk - 1)
        nn = nn[~own].reshape(len(q), kk - 1)
    return sim, nn
