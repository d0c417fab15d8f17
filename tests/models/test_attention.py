import copy
import logging

import pytest
import torch

import vitflow
from vitflow.models.attention import (
    AttentionContext,
    BlockwiseKernel,
    LinformerKernel,
    PerformerKernel,
    SparseKernel,
    attention_probs,
    grid_mask,
    make_kernel,
    math_attention,
    merge_heads,
    split_heads,
)
from vitflow.models.attention import auto as auto_mod
from vitflow.models.grad_checkpointing import saved_activation_bytes
from vitflow.models.vit.model import VisionTransformer

GRID, HEADS, DIM_HEAD = (4, 4), 3, 8


N = 1 + GRID[0] * GRID[1]


def reference(qkv, bias=None):
    """Plain autograd softmax attention on the split heads: the ground truth."""
    return merge_heads(math_attention(*split_heads(qkv, HEADS), bias=bias))


def inputs(seed=0, with_bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, N, 3 * HEADS * DIM_HEAD, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(HEADS, N, N, generator=g).requires_grad_() if with_bias else None
    return qkv, bias


EXACT = {
    "sdpa": lambda: make_kernel("sdpa", seq_len=N, head_dim=DIM_HEAD),
    "math": lambda: make_kernel("math", seq_len=N, head_dim=DIM_HEAD),
    "blockwise-5": lambda: BlockwiseKernel(block_size=5),  # 4 blocks, the last one partial
    "blockwise-64": lambda: BlockwiseKernel(block_size=64),  # one block
    "local-full": lambda: SparseKernel("local", radius=max(GRID)),  # the window covers the grid
    "auto": lambda: make_kernel("auto", seq_len=N, head_dim=DIM_HEAD),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("name", list(EXACT))
def test_exact_backends_match_math_forward_and_gradients(name, with_bias):
    """Kernel level; with_bias adds a logit bias (H, N, N), differentiated."""
    qkv, bias = inputs(1, with_bias)
    upstream = torch.randn(2, N, HEADS * DIM_HEAD, generator=torch.Generator().manual_seed(2))
    expected = reference(qkv, bias)
    exp_grads = torch.autograd.grad(expected, [qkv] + ([bias] if with_bias else []), upstream)

    qkv2, bias2 = inputs(1, with_bias)
    got = EXACT[name]()(qkv2, HEADS, AttentionContext(GRID, 1, bias2))
    got_grads = torch.autograd.grad(got, [qkv2] + ([bias2] if with_bias else []), upstream)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for g, e in zip(got_grads, exp_grads):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert exp_grads[0].abs().max() > 0.1  # a non-trivial comparison


@pytest.mark.parametrize("shape", [(2, 1, 1, N), (2, HEADS, N, N), (1, HEADS, N, N), (HEADS, N, N), (N, N)],
                         ids=["per-image-key-mask", "per-image-head", "shared-4d", "per-head", "shared-2d"])
def test_math_kernel_bias_gradient_has_the_bias_shape(shape):
    """The hand-written backward of the math kernel returns the bias's gradient summed over the
    axes it was broadcast along, whatever its shape: plain autograd's answer."""
    from vitflow.models.attention import packed_math_attention

    qkv, _ = inputs(3)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(4)).requires_grad_()
    upstream = torch.randn(2, N, HEADS * DIM_HEAD, generator=torch.Generator().manual_seed(5))
    want = torch.autograd.grad(reference(qkv, bias), [qkv, bias], upstream)
    got = torch.autograd.grad(packed_math_attention(qkv, HEADS, bias), [qkv, bias], upstream)
    assert got[1].shape == bias.shape
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "blockwise", "local", "auto"])
def test_model_backends_match_math_with_relative_bias(backend):
    """Whole model, relative position bias, attention dropout off: logits and every gradient."""
    torch.manual_seed(0)
    kw = dict(num_classes=5, pos_embed="relative", attn_block_size=7, attn_window=8)
    ref = vitflow.create_model("vit_cifar_patch4_32", attention="math", **kw)
    ours = vitflow.create_model("vit_cifar_patch4_32", attention=backend, **kw)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    ref(x).square().sum().backward()
    ours(x).square().sum().backward()
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        scale = p.grad.abs().max().clamp_min(1.0)
        torch.testing.assert_close(q.grad / scale, p.grad / scale, atol=1e-5, rtol=1e-5, msg=name)


def test_math_kernel_bf16_close_to_fp32():
    qkv, bias = inputs(3, True)
    expected = reference(qkv.detach(), bias.detach())
    got = make_kernel("math", seq_len=N, head_dim=DIM_HEAD)(qkv.detach().bfloat16(), HEADS,
                                                             AttentionContext(GRID, 1, bias.detach()))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_grid_masks_local_axial_and_class_token():
    local = grid_mask("local", (3, 3), 1, radius=1)
    axial = grid_mask("axial", (3, 3), 1)
    assert local.shape == (10, 10) and local[0].all() and local[:, 0].all()  # class token both ways
    # patch (1,1) = token 5 sees the whole 3x3 grid; corner (0,0) = token 1 sees a 2x2 window
    assert local[5, 1:].all() and local[1, 1:].sum() == 4
    assert axial[1, 1:].tolist() == [True, True, True, True, False, False, True, False, False]
    assert not grid_mask("local", (3, 3), 0, radius=0)[0, 1]  # without prefix: only itself
    with pytest.raises(ValueError, match="pattern"):
        grid_mask("diagonal", (3, 3))


@pytest.mark.parametrize("pattern", ["local", "axial"])
def test_sparse_kernel_equals_masked_softmax_and_ignores_other_keys(pattern):
    qkv, _ = inputs(4)
    kernel = SparseKernel(pattern, radius=1)
    mask = grid_mask(pattern, GRID, 1, radius=1)
    q, k, v = split_heads(qkv, HEADS)
    expected = merge_heads(attention_probs(q, k, mask=mask) @ v)
    got = kernel(qkv, HEADS, AttentionContext(GRID, 1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # changing a value outside query 5's pattern does not change query 5's output
    far = int((~mask[5]).nonzero()[0])
    qkv2 = qkv.detach().clone()
    qkv2[:, far, 2 * HEADS * DIM_HEAD:] += 10.0
    out2 = kernel(qkv2, HEADS, AttentionContext(GRID, 1))
    torch.testing.assert_close(out2[:, 5], got[:, 5].detach())
    assert not torch.allclose(out2[:, far], got[:, far].detach())


def test_flex_attention_path_matches_masked_sdpa_in_inference():
    pytest.importorskip("torch.nn.attention.flex_attention")
    qkv, _ = inputs(5)
    qkv = qkv.detach()
    ctx = AttentionContext(GRID, 1)
    with torch.no_grad():
        expected = SparseKernel("local", 1, impl="sdpa")(qkv, HEADS, ctx)
        try:
            got = SparseKernel("local", 1, impl="flex")(qkv, HEADS, ctx)
        except Exception as e:  # no C++ toolchain for torch.compile on this machine
            pytest.skip(f"compiled FlexAttention unavailable here: {type(e).__name__}")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no CPU backward"):
        SparseKernel("local", 1, impl="flex")(qkv.requires_grad_(), HEADS, ctx)


def test_blockwise_saves_linear_memory():
    """What autograd keeps for the backward: math keeps B*H*N*N probabilities, blockwise only
    q, k, v, the output and the log-sum-exp (O(N))."""
    n = 1025
    qkv = torch.randn(1, n, 3 * 2 * 16, requires_grad=True)
    ctx = AttentionContext((32, 32), 1)
    math_bytes = saved_activation_bytes(lambda: make_kernel("math", seq_len=n, head_dim=16)(qkv, 2, ctx))
    block_bytes = saved_activation_bytes(lambda: BlockwiseKernel(128)(qkv, 2, ctx))
    assert math_bytes >= 2 * n * n * 4  # the probabilities
    assert block_bytes < 4 * 2 * n * 16 * 4 + 2 * n * 4 * 2  # packed q,k,v + out + lse, no N^2 term
    assert block_bytes * 10 < math_bytes


def test_auto_times_once_logs_choice_and_keeps_rng(caplog):
    auto_mod.clear_choices()
    kernel = make_kernel("auto", seq_len=N, head_dim=DIM_HEAD)
    qkv, _ = inputs(6)
    rng = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="vitflow.models.attention.auto"):
        out = kernel(qkv, HEADS, AttentionContext(GRID, 1))
        kernel(qkv, HEADS, AttentionContext(GRID, 1))
    assert torch.equal(torch.get_rng_state(), rng)
    picks = [r for r in caplog.records if "attention=auto" in r.getMessage()]
    assert len(picks) == 1 and kernel.choice in ("sdpa", "math", "blockwise")
    assert kernel.choice in picks[0].getMessage() and "fwd+bwd" in picks[0].getMessage()
    torch.testing.assert_close(out, reference(qkv), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # inference is another key: timed again
        kernel(qkv, HEADS, AttentionContext(GRID, 1))
    assert len(auto_mod._CHOICES) == 2


@pytest.mark.parametrize("checkpointing", [False, "every:2"])
def test_auto_in_a_model_times_whole_blocks_once_per_input_and_changes_nothing(caplog, checkpointing):
    """A model chooses by timing its whole block stack per candidate; the tuning leaves the RNG
    (the drop-path masks match), the parameters' .grad and the result alone (output and gradients
    as with math)."""
    auto_mod.clear_choices()
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5,
                              attention="auto", drop_path_rate=0.1)
    model.set_grad_checkpointing(checkpointing)
    ref = copy.deepcopy(model)
    ref.set_attention_backend("math")
    x = torch.randn(4, 3, 32, 32)
    with caplog.at_level(logging.INFO, logger="vitflow.models.attention.auto"):
        torch.manual_seed(1)
        out = model(x)
        torch.manual_seed(1)
        expected = ref(x)
        assert all(p.grad is None for p in model.parameters())
        out.square().sum().backward()
        expected.square().sum().backward()
        model(x)  # same input key: no second tuning
        model.eval()
        with torch.no_grad():
            model(x)  # inference is another key
    picks = [r.getMessage() for r in caplog.records if "attention=auto" in r.getMessage()]
    assert len(picks) == 2, picks
    assert "fwd+bwd (block stack ms:" in picks[0] and "fwd (block stack ms:" in picks[1]
    assert model.blocks[0].attn.kernel.choice in ("sdpa", "math", "blockwise")
    assert model.blocks[0].attn.kernel.choice in picks[1]
    assert len(auto_mod._CHOICES) == 2  # all three blocks share each choice
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_auto_ties_go_to_the_first_candidate():
    """Within 3% of the fastest, the earlier of sdpa, math, blockwise is kept (timing noise must
    not pick the memory-saving kernel for speed); beyond it, the fastest."""
    auto_mod.clear_choices()
    key = ((2, 17, 72), 3, torch.float32, "cpu", None, False, False, ("sdpa", "math", "blockwise"), True)
    assert auto_mod._record(key, {"sdpa": 1.02, "math": 1.0, "blockwise": 0.995}, "test") == "sdpa"
    assert auto_mod._record(key, {"sdpa": 1.10, "math": 1.0, "blockwise": 0.99}, "test") == "math"
    assert auto_mod._record(key, {"sdpa": 1.10, "math": 1.05, "blockwise": 0.9}, "test") == "blockwise"
    assert auto_mod.decided(key)
    auto_mod.clear_choices()


def test_linformer_with_identity_projection_is_exact_and_fixed_length():
    kernel = LinformerKernel(seq_len=N, k=N)
    with torch.no_grad():
        kernel.proj_k.copy_(torch.eye(N))
        kernel.proj_v.copy_(torch.eye(N))
    qkv, _ = inputs(7)
    torch.testing.assert_close(kernel(qkv, HEADS, AttentionContext(GRID, 1)), reference(qkv), atol=1e-5, rtol=1e-5)
    assert LinformerKernel(seq_len=N).k == N // 4
    with pytest.raises(ValueError, match="built for 17 tokens"):
        kernel(torch.randn(2, 26, 3 * HEADS * DIM_HEAD), HEADS, AttentionContext((5, 5), 1))


def test_performer_approximates_softmax_attention():
    """FAVOR+ is an unbiased estimator of the softmax kernel: with many features the output
    approaches exact attention; with few it is rougher."""
    torch.manual_seed(0)
    qkv = torch.randn(2, N, 3 * HEADS * DIM_HEAD) * 0.5
    exact = reference(qkv)
    errors = {}
    for m in (16, 4096):
        kernel = PerformerKernel(DIM_HEAD, num_features=m)
        errors[m] = float((kernel(qkv, HEADS, AttentionContext(GRID, 1)) - exact).norm() / exact.norm())
    assert errors[4096] < 0.05 and errors[4096] < errors[16]
    before = kernel.features.clone()
    kernel.redraw_features(torch.Generator().manual_seed(1))
    assert not torch.equal(before, kernel.features)
    assert PerformerKernel(64).num_features == 266  # round(d ln d)


def test_backend_errors_are_clear():
    with pytest.raises(ValueError, match="choose one of sdpa, math, blockwise"):
        make_kernel("flash", seq_len=N, head_dim=DIM_HEAD)
    with pytest.raises(ValueError, match="relative position bias"):
        vitflow.create_model("vit_digits_patch2_8", attention="linformer", pos_embed="relative")
    with pytest.raises(ValueError, match="dropout"):
        BlockwiseKernel(8)(inputs()[0], HEADS, AttentionContext(GRID, 1, None, 0.1))
    m = vitflow.create_model("vit_digits_patch2_8", attention="linformer")
    with pytest.raises(ValueError, match="training input size"):
        m(torch.randn(1, 3, 12, 12))


def test_set_attention_backend_keeps_weights_and_outputs():
    torch.manual_seed(0)
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=4).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = m(x)
        m.set_attention_backend("blockwise", block_size=16)
        assert m.attention_backend == "blockwise" and m.blocks[3].attn.kernel.block_size == 16
        torch.testing.assert_close(m(x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend,steps", [("linformer", 200), ("performer", 500)])
def test_linear_attention_trains_on_digits(backend, steps, tmp_path):
    """The embedded digits task (default preset, shorter) with a linear-complexity backend:
    >= 80% top-1 on the held-out 20%."""
    from vitflow.config import build_config
    from vitflow.training import train

    cfg = build_config(overrides=[f"model.attention={backend}", f"train.total_steps={steps}", "train.eval_every=0",
                                  "train.log_every=100", f"train.run_dir={tmp_path}"])
    result = train(cfg)
    assert result["test_top1"] >= 0.80, result
