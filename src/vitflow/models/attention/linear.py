"""Linear-complexity approximations of softmax attention: Linformer and Performer (FAVOR+)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from vitflow.models.attention.core import AttentionKernel


class LinformerKernel(AttentionKernel):
    """Linformer (Wang et al. 2020, "Self-Attention with Linear Complexity").

    Keys and values are projected along the sequence, ``K' = E K``, ``V' = F V`` with learned
    ``E, F`` of shape ``(k, N)`` shared by the heads of a layer (the paper's headwise sharing),
    then ``softmax(Q K'^T / sqrt(d)) V'``: time and memory ``O(N k)``. ``E`` and ``F`` are
    ``proj_k`` and ``proj_v``, initialised ``U(-1/sqrt(k), 1/sqrt(k))``.

    The sequence length is fixed at construction (the projections have ``N`` columns).

    Raises:
        ValueError: ``k < 1``; at run time, another sequence length than ``seq_len``.
    """

    exact = False
    supports_bias = False

    def __init__(self, seq_len: int, k: int | None = None):
        super().__init__()
        k = max(seq_len // 4, 1) if k is None else k
        if k < 1:
            raise ValueError(f"linformer k must be >= 1, got {k}")
        self.seq_len, self.k = seq_len, k
        bound = 1.0 / math.sqrt(k)
        self.proj_k = nn.Parameter(torch.empty(k, seq_len).uniform_(-bound, bound))
        self.proj_v = nn.Parameter(torch.empty(k, seq_len).uniform_(-bound, bound))

    def attend(self, q, k, v, ctx):
        if ctx.bias is not None:
            raise ValueError("attention=linformer cannot add a relative position bias (its keys are projected)")
        if k.shape[-2] != self.seq_len:
            raise ValueError(f"attention=linformer was built for {self.seq_len} tokens, got {k.shape[-2]}: "
                             "Linformer needs the training input size")
        k = torch.matmul(self.proj_k.to(k.dtype), k)
        v = torch.matmul(self.proj_v.to(v.dtype), v)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=ctx.dropout_p)

    def extra_repr(self) -> str:
        return f"seq_len={self.seq_len}, k={self.k}"


def orthogonal_gaussian(num_features: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(num_features, dim)`` random features: blocks of ``dim`` orthogonal directions (QR of a
    Gaussian matrix) with row norms drawn from the chi distribution of a Gaussian vector, so each
    row is marginally ``N(0, I)`` (FAVOR+'s orthogonal random features, Choromanski et al. 2021)."""
    g = torch.randn(math.ceil(num_features / dim), dim, dim, generator=generator)
    qmat, r = torch.linalg.qr(g)
    qmat = qmat * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-distributed directions
    w = qmat.transpose(-2, -1).reshape(-1, dim)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator).norm(dim=1, keepdim=True)
    return w * norms


class PerformerKernel(AttentionKernel):
    """Performer's FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers").

    Softmax attention ``exp(q.k / sqrt(d))`` is approximated with positive random features
    ``phi(x) = exp(w_i . x' - |x'|^2 / 2) / sqrt(m)`` of ``x' = x / d^(1/4)``, ``m`` orthogonal
    Gaussian ``w_i`` (buffer ``features``, saved with the weights), and evaluated in linear time:
    ``out = phi(Q) (phi(K)^T V) / (phi(Q) phi(K)^T 1)``. Computed in fp32 with per-row (queries)
    and per-head (keys) max subtraction for stability, as in the reference implementation.
    Attention dropout does not apply (there are no explicit probabilities).

    Args:
        head_dim: ``d``.
        num_features: ``m``; default ``round(d ln d)`` (the paper's recommendation).
    """

    exact = False
    supports_bias = False

    def __init__(self, head_dim: int, num_features: int | None = None, eps: float = 1e-6):
        super().__init__()
        if num_features is None:
            num_features = max(int(round(head_dim * math.log(head_dim))), 1)
        self.num_features = num_features
        if self.num_features < 1:
            raise ValueError(f"performer num_features must be >= 1, got {num_features}")
        self.head_dim, self.eps = head_dim, eps
        self.register_buffer("features", orthogonal_gaussian(self.num_features, head_dim))

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Draw a fresh set of random features in place (FAVOR+ periodic redrawing)."""
        self.features.copy_(orthogonal_gaussian(self.num_features, self.head_dim, generator))

    def _phi(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        x = x * self.head_dim ** -0.25
        proj = x @ self.features.T
        sq = x.pow(2).sum(dim=-1, keepdim=True) / 2
        dims = -1 if is_query else (-1, -2)
        stab = proj.amax(dim=dims, keepdim=True).detach()
        return (torch.exp(proj - sq - stab) + self.eps) * self.num_features ** -0.5

    def attend(self, q, k, v, ctx):
        if ctx.bias is not None:
            raise ValueError("attention=performer cannot add a relative position bias")
        dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.float(), k.float(), v.float()
            qp, kp = self._phi(q, True), self._phi(k, False)
            kv = kp.transpose(-2, -1) @ v  # (B, H, m, d)
            norm = qp @ kp.sum(dim=-2).unsqueeze(-1)  # (B, H, N, 1)
            out = (qp @ kv) / norm
        return out.to(dtype)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}"
