"""Token merging (ToMe; Bolya et al., "Token Merging: Your ViT But Faster", ICLR 2023).

Between the attention and the MLP of a block, ``r`` patch tokens are merged into their most
similar neighbours, so every later block runs on fewer tokens: a ViT-S/16 at 224 px with ``r=8``
in each of its 12 blocks ends with 101 of its 197 tokens, and the blocks' FLOPs fall by about 40%.
No training is needed (merging is applied to a trained model); the accuracy cost grows with ``r``
and is measured by ``vitflow bench infer`` and the accuracy guard, not assumed.

Per block, with ``metric`` the keys averaged over the heads (the paper's choice):

1. **Bipartite soft matching.** The patch tokens are split alternately into sets A (even
   positions) and B (odd positions); each A token's most similar B token is found by cosine
   similarity; the ``r`` A tokens with the most similar partners are merged into them. One
   matrix product of ``|A| x |B|``, no iteration, and no token is merged twice in a block.
2. **Size-weighted averages.** Every token carries its size ``s`` (how many patches it
   stands for); a merge is the ``s``-weighted mean of the features, sizes add.
3. **Proportional attention.** ``softmax(Q K^T / sqrt(d) + log s)``: a token standing for
   ``s`` patches gets the attention ``s`` copies would.

The prefix tokens (class, registers) take no part in matching: they stay first, unmerged, so
``global_pool="token"`` reads the class token as before. After merging the order is: prefix
tokens, the unmerged A tokens (in their original order), then the B tokens (in theirs).
``global_pool="avg"`` pools with the sizes as weights (the mean over the patches).
"""

from __future__ import annotations

from typing import Sequence

import torch

from vitflow.models.attention import AttentionContext, merge_heads, sdpa_attention, split_heads


def merge_schedule(r: int | Sequence[int], depth: int, num_patches: int) -> list[int]:
    """Tokens merged in each block: ``r`` in every block (an int) or one per block (a list of
    ``depth`` ints), each capped at what the block can merge (half of the patch tokens entering
    it, rounded down, so that a B token is left for every merged A token).

    Raises:
        ValueError: a negative ``r``, or a list whose length is not ``depth``.
    """
    wanted = [int(r)] * depth if isinstance(r, int) else [int(v) for v in r]
    if len(wanted) != depth:
        raise ValueError(f"model.token_merge: {len(wanted)} values for a {depth}-block model (give one per block, "
                         "or one int for all)")
    if any(v < 0 for v in wanted):
        raise ValueError(f"model.token_merge: {list(r) if not isinstance(r, int) else r} holds a negative count")
    out, n = [], num_patches
    for v in wanted:
        v = min(v, n // 2)
        out.append(v)
        n -= v
    return out


def default_merge(num_patches: int, depth: int) -> int:
    """The ``r`` that merges about half of the patch tokens by the last block,
    ``round(num_patches / (2 * depth))`` (at least 1): ToMe's ``r=8`` for ViT-S/16 at 224 px
    (196 patches, 12 blocks). A starting point; the accuracy guard chooses ``r`` on real images."""
    return max(1, round(num_patches / (2 * depth)))


def merge_tokens(x: torch.Tensor, size: torch.Tensor, metric: torch.Tensor, r: int,
                 num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` patch tokens of ``x`` by bipartite soft matching on ``metric``.

    The merge is two batched products with 0/1 matrices (:func:`merge_matrices`) rather than
    gathers and a scatter-add: the same sums (float32 under autocast), and GEMMs that a runtime
    (OpenVINO, ONNX Runtime) runs at the speed of the model's own, where its scatter and second
    top-k cost about what the merged tokens saved (the CIFAR ViT's INT8 IR at ``r=6``: 0.98x the
    unmerged model's throughput with them, see the deployment guide). The products cost
    ``O(N^2 D)``: a few percent of a block's FLOPs up to ViT-L at 518 px.

    Args:
        x: tokens ``(B, N, D)``; size: their sizes ``(B, N, 1)`` (same dtype as ``x``).
        metric: ``(B, N, C)`` the similarity features (the keys averaged over the heads).
        r: tokens to merge, at most half of the ``N - num_prefix_tokens`` patch tokens.
    Returns:
        ``(x, size)`` with ``N - r`` tokens, in the order of the module docstring.
    """
    if r <= 0:
        return x, size
    p = num_prefix_tokens
    with torch.autocast(x.device.type, enabled=False):
        m = metric[:, p:].float()
        m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        scores = m[:, ::2] @ m[:, 1::2].transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
        best, partner = scores.max(dim=-1)
        src = best.topk(r, dim=-1).indices  # (B, r): the A tokens merged ...
        dst = partner.gather(1, src)  # ... into these B tokens
        keep, into_b = merge_matrices(src, dst, scores.shape[-2], scores.shape[-1], x.dtype)
        # size-weighted sums of the features, and the sizes, as one tensor
        t = torch.cat([x[:, p:] * size[:, p:], size[:, p:]], dim=-1)
        a, b = t[:, ::2], t[:, 1::2]
        t = torch.cat([keep @ a, into_b @ a + b], dim=1)
    total = t[..., -1:].detach()  # counts: no gradient (t's slice would carry the features')
    return torch.cat([x[:, :p], t[..., :-1] / total], dim=1), torch.cat([size[:, :p], total], dim=1)


def merge_matrices(src: torch.Tensor, dst: torch.Tensor, n_a: int, n_b: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0/1 matrices of one merge step: A tokens ``src`` ``int64 (B, r)`` merged into B tokens
    ``dst`` ``(B, r)``, of ``n_a`` A and ``n_b`` B tokens.

    Returns:
        ``(keep (B, n_a - r, n_a), into_b (B, n_b, n_a))`` of ``dtype``: ``keep`` row ``i`` picks
        the ``i``-th A token not merged (in their original order: the running count of kept
        tokens, so no sort); ``into_b[j, a]`` is 1 when A token ``a`` is merged into B token ``j``.
    """
    r = src.shape[-1]
    e_src = (src[..., None] == torch.arange(n_a, device=src.device)).to(dtype)  # (B, r, n_a)
    kept = 1 - e_src.sum(1)  # (B, n_a): 1 for the A tokens that stay
    row = kept.cumsum(-1) - 1  # the output row of each kept A token
    rows = torch.arange(n_a - r, device=src.device, dtype=dtype)[None, :, None]
    keep = (row[:, None, :] == rows).to(dtype) * kept[:, None, :]
    e_dst = (dst[..., None] == torch.arange(n_b, device=dst.device)).to(dtype)  # (B, r, n_b)
    return keep, e_dst.transpose(1, 2) @ e_src


def head_mean(k: torch.Tensor) -> torch.Tensor:
    """The keys ``(B, H, N, d)`` averaged over the heads, ``(B, N, d)``: the matching's metric. A
    sum of the heads' slices (elementwise adds a runtime fuses) rather than a reduction over the
    head axis, which OpenVINO ran as a strided ReduceMean taking about a tenth of the CIFAR ViT's
    merged INT8 graph at batch 16 (the same sum of token-major slices, ``k.transpose(1, 2)``,
    breaks ONNX Runtime's transformer optimizer: "Graph is not a DAG")."""
    heads = k.unbind(1)
    return sum(heads[1:], heads[0]) / len(heads)


def merging_block(block: torch.nn.Module, x: torch.Tensor, size: torch.Tensor | None, r: int,
                  num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pre-norm encoder block (:class:`vitflow.models.block.Block`) with proportional attention
    and ``r`` tokens merged between its attention and its MLP.

    Args:
        block: the block, its own modules used as they are (the attention's projections and
            kernel, with ``log(size)`` as the kernel's logit bias; LayerScale, stochastic depth,
            MLP); its attention must be softmax attention without a position bias
            (:func:`check_mergeable`); an export form (the split q / k / v projections of
            :mod:`vitflow.infer.export.deployable`, its ``heads``) runs in eval mode.
        x: ``(B, N, D)``; size: ``(B, N, 1)`` or ``None`` (every token one patch: no bias).
    Returns:
        ``(x, size)``: ``(B, N - r, D)`` and the sizes (``None`` while nothing was merged).
    """
    attn = block.attn
    fused = block.residual_in_gemm()  # the residual add inside the branches' last GEMMs, as Block.forward
    bias = None if size is None else size.float().log()[:, None, None, :, 0]  # (B, 1, 1, N): log s per key
    if hasattr(attn, "kernel"):  # vitflow's attention: its own kernel, the log-size bias as its logit bias
        qkv = attn.qkv(block.norm1(x))
        k = split_heads(qkv, attn.num_heads)[1]
        h = attn.kernel(qkv, attn.num_heads, AttentionContext(attn.grid, num_prefix_tokens, bias,
                                                               attn.attn_drop if attn.training else 0.0))
    else:  # an export form: split q, k, v projections
        q, k, v = attn.heads(block.norm1(x))
        h = merge_heads(sdpa_attention(q, k, v, 0.0, bias))
    if fused:
        x = attn.proj(h, residual=x)
    else:
        dropout = getattr(attn, "proj_drop", None)  # (an export form has none)
        h = attn.proj(h)
        x = x + block.drop_path1(block.ls1(dropout(h) if dropout is not None else h))
    if r > 0:
        if size is None:
            size = x.new_ones(x.shape[0], x.shape[1], 1)
        x, size = merge_tokens(x, size, head_mean(k), r, num_prefix_tokens)
    if fused:
        return block.mlp(block.norm2(x), residual=x), size
    return x + block.drop_path2(block.ls2(block.mlp(block.norm2(x)))), size


def merge_through(blocks: Sequence[torch.nn.Module], x: torch.Tensor, schedule: Sequence[int],
                  num_prefix_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens ``(B, N, D)`` through every block of ``blocks`` with ``schedule[i]`` tokens merged in
    block ``i`` (:func:`merging_block`): ``(tokens (B, N - sum(schedule), D), sizes (B, N', 1) or None)``."""
    size = None
    for blk, r in zip(blocks, schedule):
        x, size = merging_block(blk, x, size, r, num_prefix_tokens)
    return x, size


def check_mergeable(model: torch.nn.Module) -> None:
    """Raises ValueError (one line naming the setting) unless every block of ``model`` can merge:
    softmax attention over all keys (not ``linformer``, ``performer`` or a sparse pattern) and
    no relative position bias (merged tokens have no grid position), a pooling
    other than ``map``."""
    if getattr(model, "global_pool", "token") == "map":
        raise ValueError("model.token_merge: global_pool=map is not supported (its attention pool would need "
                         "proportional attention too); use token or avg pooling")
    for i, blk in enumerate(model.blocks):
        attn = blk.attn
        if getattr(attn, "rel_pos", None) is not None:
            raise ValueError("model.token_merge needs absolute position embeddings: merged tokens have no grid "
                             f"position for pos_embed=relative (block {i})")
        if not attn.kernel.exact:
            raise ValueError(f"model.token_merge needs softmax attention over all tokens; block {i} has "
                             f"attention={attn.backend}")
