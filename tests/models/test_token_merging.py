"""Token merging (ToMe): the vectorised merge inside the ViT agrees with a straightforward
per-image implementation written from the paper (loops over tokens, explicit softmax with the
log-size bias), schedules are capped and checked, and models that cannot merge say why."""

from __future__ import annotations

import math

import pytest
import torch

from vitflow.models.token_merging import merge_matrices, merge_schedule, merge_tokens
from vitflow.models.vit.model import VisionTransformer


def _model(global_pool: str = "token", reg_tokens: int = 0, **kw) -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(img_size=16, patch_size=2, embed_dim=32, depth=3, num_heads=2, num_classes=5,
                          global_pool=global_pool, reg_tokens=reg_tokens, **kw).eval()
    with torch.no_grad():  # weights far from their near-zero init, so that tokens differ
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def _reference_block(blk, t: torch.Tensor, size: list[float], r: int, p: int) -> tuple[torch.Tensor, list[float]]:
    """One block on one image's tokens ``(N, D)``, from the paper: proportional attention head by
    head, then bipartite matching token by token."""
    n = t.shape[0]
    heads = blk.attn.num_heads
    qkv = blk.attn.qkv(blk.norm1(t))
    d = qkv.shape[-1] // (3 * heads)
    q, k, v = qkv.view(n, 3, heads, d).unbind(1)
    log_size = torch.tensor([math.log(s) for s in size])
    out = [torch.softmax(q[:, h] @ k[:, h].T / math.sqrt(d) + log_size[None, :], dim=-1) @ v[:, h] for h in range(heads)]
    t = t + blk.ls1(blk.attn.proj(torch.cat(out, dim=-1)))
    if r:
        metric = k.mean(dim=1)
        a_side, b_side = list(range(p, n))[0::2], list(range(p, n))[1::2]
        best = {}
        for a in a_side:
            sims = [torch.cosine_similarity(metric[a], metric[b], dim=0).item() for b in b_side]
            j = max(range(len(sims)), key=lambda i: sims[i])  # the first of equals, as the vectorised max
            best[a] = (sims[j], b_side[j])
        merged = sorted(a_side, key=lambda a: -best[a][0])[:r]  # sorted() is stable
        groups = {b: [b] for b in b_side}
        for a in merged:
            groups[best[a][1]].append(a)
        rows, sizes = [t[i] for i in range(p)], size[:p]
        for a in a_side:
            if a not in merged:
                rows.append(t[a])
                sizes.append(size[a])
        for b in b_side:
            total = sum(size[i] for i in groups[b])
            rows.append(sum(t[i] * size[i] for i in groups[b]) / total)
            sizes.append(total)
        t, size = torch.stack(rows), sizes
    return t + blk.ls2(blk.mlp(blk.norm2(t))), size


@torch.no_grad()
def _reference_logits(model: VisionTransformer, x: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    tokens, _ = model._embed(x)
    p, out = model.num_prefix_tokens, []
    for t in model.norm_pre(tokens):
        size = [1.0] * t.shape[0]
        for blk, r in zip(model.blocks, schedule):
            t, size = _reference_block(blk, t, size, r, p)
        t = model.norm(t)
        if model.global_pool == "token":
            pooled = t[0]
        else:
            w = torch.tensor(size[p:])[:, None]
            pooled = (t[p:] * w).sum(0) / w.sum()
        out.append(model.head(model.fc_norm(pooled)))
    return torch.stack(out)


@pytest.mark.parametrize("global_pool,reg_tokens,r", [("token", 0, 6), ("avg", 0, [10, 0, 7]), ("token", 2, 9)])
def test_merged_forward_equals_the_reference(global_pool, reg_tokens, r):
    model = _model(global_pool, reg_tokens)
    x = torch.randn(3, 3, 16, 16)
    schedule = merge_schedule(r, 3, 64)
    model.set_token_merge(r)
    with torch.no_grad():
        got = model(x)
        tokens = model.forward_features(x)
    torch.testing.assert_close(got, _reference_logits(model, x, schedule), atol=1e-5, rtol=1e-5)
    assert tokens.shape[1] == model.num_prefix_tokens + 64 - sum(schedule)
    model.set_token_merge(0)
    with torch.no_grad():
        plain = model(x)
    assert not torch.allclose(plain, got, atol=1e-3)  # merging changed the answer ...
    torch.testing.assert_close(plain, _reference_logits(model, x, [0, 0, 0]), atol=1e-5, rtol=1e-5)  # ... r=0 did not


def test_embeddings_of_a_merging_model_are_its_classifier_input():
    """``pooled_features`` (vitflow embed, inspect, the service's /embed) pools merged tokens by the
    patches each holds, as the model's head does: the head of the embedding is the model's logits."""
    from vitflow.infer.features.embed import pooled_features

    model = _model("avg", 0)
    model.set_token_merge([10, 0, 7])
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        logits, pooled = model(x), pooled_features(model, x)
        unweighted = model.forward_head(model.forward_features(x), pre_logits=True)
    torch.testing.assert_close(model.head(pooled), logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unweighted, pooled, atol=1e-3)  # a plain mean of the merged tokens is not it


def test_merge_keeps_the_prefix_first_and_the_total_size():
    torch.manual_seed(1)
    x, metric = torch.randn(2, 1 + 10, 4), torch.randn(2, 1 + 10, 8)
    size = torch.ones(2, 11, 1)
    merged, sizes = merge_tokens(x, size, metric, 4, num_prefix_tokens=1)
    assert merged.shape == (2, 7, 4) and torch.equal(merged[:, 0], x[:, 0])
    assert sizes[:, 1:].sum(dim=1).flatten().tolist() == [10.0, 10.0] and sizes.max().item() <= 5
    # the size-weighted mean is kept: sum of size * features before and after
    torch.testing.assert_close((merged * sizes)[:, 1:].sum(1), x[:, 1:].sum(1), atol=1e-5, rtol=1e-5)


def test_merge_matrices_pick_the_kept_tokens_in_order_and_route_the_merged_ones():
    # 4 A tokens, 3 B tokens: A 2 and A 0 merge into B 1; A 1 and A 3 stay, in that order
    keep, into_b = merge_matrices(torch.tensor([[2, 0]]), torch.tensor([[1, 1]]), 4, 3, torch.float32)
    assert keep.tolist() == [[[0, 1, 0, 0], [0, 0, 0, 1]]]
    assert into_b.tolist() == [[[0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]]


def test_merge_under_bf16_autocast_matches_and_sums_in_float32():
    """The matching and the merged sums run in float32 under autocast: bit for bit the float32
    merge (a bf16 similarity product could pick other pairs, a bf16 product round the sums)."""
    torch.manual_seed(2)
    x, metric = torch.randn(3, 1 + 40, 16), torch.randn(3, 1 + 40, 8)
    size = torch.randint(1, 5, (3, 41, 1)).float()
    want = merge_tokens(x, size, metric, 12, num_prefix_tokens=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = merge_tokens(x, size, metric, 12, num_prefix_tokens=1)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_schedule_is_capped_and_checked():
    assert merge_schedule(8, 4, 64) == [8, 8, 8, 8]
    assert merge_schedule(30, 3, 64) == [30, 17, 8]  # at most half of the tokens entering each block
    assert merge_schedule([0, 5], 2, 64) == [0, 5]
    with pytest.raises(ValueError, match="3 values for a 2-block"):
        merge_schedule([1, 2, 3], 2, 64)
    with pytest.raises(ValueError, match="negative"):
        merge_schedule(-1, 2, 64)


@pytest.mark.parametrize("kw,match", [({"pos_embed": "relative"}, "absolute position"),
                                       ({"attention": "linformer"}, "attention=linformer"),
                                       ({"global_pool": "map"}, "global_pool=map")])
def test_models_that_cannot_merge_say_why(kw, match):
    with pytest.raises(ValueError, match=match):
        VisionTransformer(img_size=16, patch_size=2, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                          token_merge=4, **kw)


def test_training_through_merged_blocks_has_gradients():
    model = _model("avg")
    model.set_token_merge(8)
    model.train()
    loss = model(torch.randn(4, 3, 16, 16)).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_a_run_trains_with_merging_and_its_checkpoint_keeps_it(tmp_path):
    """``model.token_merge`` reaches the model in training and is saved in ``model_args``; the
    config check refuses it with an attention that cannot take any token set."""
    from helpers import digits_config
    from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
    from vitflow.config import ConfigError
    from vitflow.models.vit.checks import check_vit_config
    from vitflow.training import train

    summary = train(digits_config(tmp_path / "run", "model.token_merge=2", "train.total_steps=12", "train.eval_every=0",
                                  "train.log_every=6"))
    state = load_checkpoint(tmp_path / "run")
    assert state["model_args"]["token_merge"] == 2 and model_from_checkpoint(state).token_merge == 2
    assert 0 <= summary["test_top1"] <= 1
    cfg = digits_config(tmp_path / "bad", "model.token_merge=2", "model.attention=linformer")
    with pytest.raises(ConfigError, match="model.token_merge"):
        check_vit_config(cfg.model)
