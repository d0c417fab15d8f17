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
    m = metric[:, p:].float()
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    scores = m[:, ::2] @ m[:, 1::2].transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
    best, partner = scores.max(dim=-1)
    src = best.topk(r, dim=-1).indices[..., None]  # (B, r, 1): the A tokens merged ...
    dst = partner[..., None].gather(1, src)  # ... into these B tokens
    # the other A tokens in their original order: the top |A| - r of -position, the merged ones pushed below
    # (top-k rather than a sort: ONNX has TopK, and no stable sort)
    n_a = best.shape[-1]
    position = torch.arange(n_a, device=best.device, dtype=best.dtype).expand_as(best)
    merged_away = torch.zeros_like(best).scatter(1, src[..., 0], float(n_a))
    kept = (-position - merged_away).topk(n_a - r, dim=-1).indices[..., None]

    # size-weighted sums of the features, and the sizes, as one tensor: one gather and one scatter-add
    t = torch.cat([x[:, p:] * size[:, p:], size[:, p:]], dim=-1)
    a, b = t[:, ::2], t[:, 1::2]
    c = t.shape[-1]
    b = b.scatter_add(1, dst.expand(-1, -1, c), a.gather(1, src.expand(-1, -1, c)))
    t = torch.cat([a.gather(1, kept.expand(-1, -1, c)), b], dim=1)
    total = t[..., -1:].detach()  # counts: no gradient (t's slice would carry the features')
    return torch.cat([x[:, :p], t[..., :-1] / total], dim=1), torch.cat([size[:, :p], total], dim=1)


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
        x, size = merge_tokens(x, size, k.mean(dim=1), r, num_prefix_tokens)
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
