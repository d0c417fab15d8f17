import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import RecordedOps
from vitflow.models.kernels import matmul, onednn
from vitflow.models.kernels.matmul import Linear, linear_fp32_gemm
from vitflow.models.vit.model import VisionTransformer

BF16 = torch.bfloat16


def _autocast():
    return torch.autocast("cpu", dtype=BF16)


def _operands(seed=0, rows=37, k=48, n=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, requires_grad=True)
    w = (torch.randn(n, k, generator=g) * 0.2).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    return x, w, b


def _residual_operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = Linear(6, 8)
    with torch.no_grad():
        layer.bias.normal_(generator=g)  # nn.Linear's default bias is random too; make it explicit
    residual = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    x = torch.randn(2, 5, 6, generator=g, requires_grad=True)
    return layer, residual, x


def test_fp32_gemm_is_the_bf16_product_rounded_once():
    """Forward: the exact product of the bf16-rounded operands (float64 here), rounded to bf16 —
    so it matches native bf16 autocast to one bf16 rounding step. Gradients: those of the same
    bf16-rounded operands, to fp32 accuracy."""
    x, w, b = _operands()
    x16, w16 = x.detach().to(BF16).double(), w.detach().to(BF16).double()
    exact = x16 @ w16.t() + b.detach().to(BF16).double()  # autocast rounds the bias too
    with _autocast():
        got = linear_fp32_gemm(x, w, b)
        native = F.linear(x, w, b)
    assert got.dtype == native.dtype == BF16
    ulp = exact.abs().clamp_min(1e-3) * 2.0**-7  # one bf16 step
    assert ((got.double() - exact).abs() <= ulp).all()
    assert ((native.double() - exact).abs() <= ulp).all()
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    gx, gw, gb = torch.autograd.grad(got, [x, w, b], upstream.to(BF16))
    u = upstream.to(BF16).double()
    torch.testing.assert_close(gx.double(), u @ w16, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), u.t() @ x16, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb.double(), u.sum(0), rtol=1e-5, atol=1e-5)
    assert gx.dtype == gw.dtype == gb.dtype == torch.float32


def test_fp32_gemm_keeps_only_bf16_tensors_for_the_backward():
    x, w, b = _operands()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t), _autocast():
        linear_fp32_gemm(x, w, b)
    assert saved == [BF16, BF16]


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_an_in_place_op_may_follow_either_gemm(gemm):
    """A bf16-autocast Linear's output is no view of a tensor made inside the autograd function
    (autograd forbids modifying such a view in place): ``Linear -> ReLU(inplace=True)``, as Swin
    V2's position-bias MLP has, trains in both modes with the plain layer's result to bf16 precision."""
    _, w, b = _operands(rows=1)
    x = torch.randn(3, 29, 48, generator=torch.Generator().manual_seed(1))
    layer = Linear(48, 24, gemm=gemm)
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
    with _autocast():
        y = torch.relu_(layer(x))
    y.float().sum().backward()
    assert y.dtype == BF16 and y.shape == (3, 29, 24)
    torch.testing.assert_close(y.float(), F.relu(F.linear(x, w, b)), rtol=2e-2, atol=2e-2)
    assert torch.isfinite(layer.weight.grad).all() and layer.weight.grad.abs().sum() > 0


def _autocast_and_ours(layer, x, grad):
    """``(y, x.grad, weight.grad, bias.grad, ops seen)`` of native autocast's ``F.linear`` and of
    ``layer``, forward and backward under bf16 autocast."""
    results = []
    for run in (lambda: F.linear(x, layer.weight, layer.bias), lambda: layer(x)):
        x.grad = layer.weight.grad = layer.bias.grad = None
        with _autocast(), RecordedOps() as seen:
            y = run()
            y.backward(grad)
        results.append((y, x.grad, layer.weight.grad, layer.bias.grad, seen.ops))
    return results


@pytest.mark.skipif(not onednn.BF16, reason="no oneDNN bf16 kernels on this CPU")
@pytest.mark.parametrize("lead", [(37,), (3, 29)])
def test_native_bf16_adds_the_bias_in_the_gemm_bit_equal_to_autocast(lead):
    """The native kernel hands the bias to oneDNN (no addmm, no copy of the broadcast bias into
    the output); output and every gradient equal native autocast's F.linear bit for bit."""
    _, w, b = _operands(rows=1)
    x = torch.randn(*lead, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)
    layer = Linear(48, 24, gemm="bf16")
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
    grad = torch.randn(*lead, 24, generator=torch.Generator().manual_seed(2)).to(BF16)
    (*native, native_ops), (*ours, ours_ops) = _autocast_and_ours(layer, x, grad)
    assert "addmm" in native_ops and "addmm" not in ours_ops and "_linear_pointwise" in ours_ops
    for a, b_ in zip(native, ours):
        assert a.dtype == b_.dtype and torch.equal(a, b_)
    assert ours[0].dtype == BF16 and ours[2].dtype == torch.float32


@pytest.mark.skipif(not onednn.BF16, reason="no oneDNN bf16 kernels on this CPU")
def test_long_batches_weight_and_bias_gradients(monkeypatch):
    """From SPLIT_ROWS rows the native kernel's weight gradient is one bmm over two half-batches,
    summed in fp32: each half rounded to bf16 (as autocast's single product is), and the bias
    gradient ``ones @ g`` (within one bf16 rounding of the exact sum); output and input gradient
    stay bit-equal. Below it (odd row counts too for the weight) autocast's ops, bit-equal."""
    monkeypatch.setattr(matmul, "SPLIT_ROWS", 64)
    layer = Linear(48, 24, gemm="bf16")
    for rows, split in ((128, True), (63, False), (65, False)):  # split: the weight's (an even count)
        long = rows >= matmul.SPLIT_ROWS
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows), requires_grad=True)
        grad = torch.randn(rows, 24, generator=torch.Generator().manual_seed(2)).to(BF16)
        (y0, gx0, gw0, gb0, _), (y1, gx1, gw1, gb1, ops) = _autocast_and_ours(layer, x, grad)
        assert ("bmm" in ops) == split, rows
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
        if long:  # ones @ g: fp32 accumulation, one rounding to bf16 (another summation order than sum's)
            exact = grad.double().sum(0)
            assert ((gb1.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()
            torch.testing.assert_close(gb1, gb0, atol=0, rtol=2 ** -7)
        else:
            assert torch.equal(gb0, gb1)
        if split:  # bf16 rounding of each half's product (not of the total): |error| <= 2^-8 (|h1| + |h2|)
            g64, x64 = grad.double(), x.detach().bfloat16().double()
            h1, h2 = g64[:rows // 2].t() @ x64[:rows // 2], g64[rows // 2:].t() @ x64[rows // 2:]
            assert ((gw1.double() - (h1 + h2)).abs() <= 2 ** -8 * (h1.abs() + h2.abs()) + 1e-6).all()
            torch.testing.assert_close(gw1, gw0, atol=0.2, rtol=0.02)
        else:
            assert torch.equal(gw1, gw0)


def test_linear_is_the_plain_layer_outside_bf16_cpu_autocast():
    layer = Linear(8, 4, gemm="fp32")
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # fp32: no autocast, the plain layer
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}  # nn.Linear's names: timm weights load as they are


def test_auto_times_each_shape_once_logs_and_keeps_the_rng(caplog):
    matmul.clear_choices()
    layer = Linear(48, 24)
    x = torch.randn(37, 48)
    rng = torch.get_rng_state()
    with caplog.at_level(logging.DEBUG, logger="vitflow.models.kernels.matmul"), _autocast():
        y = layer(x)
        layer(x)
        with torch.no_grad():
            layer(x)  # inference: another key
    assert torch.equal(torch.get_rng_state(), rng)
    picks = [r.getMessage() for r in caplog.records if "cpu_bf16_matmul=auto" in r.getMessage()]
    assert len(picks) == 2 and "(37 x 48) @ (48 x 24)^T, fwd+bwd" in picks[0] and picks[1].endswith(")")
    choice = picks[0].split(": ")[1].split()[0]
    assert choice in ("bf16", "fp32")
    layer.gemm = choice
    with _autocast():
        expected = layer(x)
    assert torch.equal(y, expected)


def test_model_modes_agree_to_bf16_precision():
    torch.manual_seed(0)
    models = {m: VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                                   attention="math", cpu_bf16_matmul=m) for m in ("bf16", "fp32")}
    models["fp32"].load_state_dict(models["bf16"].state_dict())
    x = torch.randn(6, 3, 16, 16)
    out, grads = {}, {}
    for mode, model in models.items():
        with _autocast():
            out[mode] = model(x)
        out[mode].float().square().mean().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert out["fp32"].dtype == BF16
    torch.testing.assert_close(out["fp32"].float(), out["bf16"].float(), atol=0.05, rtol=0.02)
    cos = F.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cos > 0.999, cos
    with pytest.raises(ValueError, match="cpu_bf16_matmul must be one of auto, bf16, fp32, got 'fp64'"):
        models["fp32"].set_cpu_bf16_matmul("fp64")


def test_auto_inside_gradient_checkpointing_trains_and_times_every_attention_candidate(caplog):
    """The first (timing) call of a shape may run inside a checkpointed block: the timing must not
    touch the checkpoint's saved tensors (a recompute mismatch error otherwise), nor make the
    attention tuner's candidates fail."""
    from vitflow.models.attention import auto as attention_auto

    matmul.clear_choices()
    attention_auto.clear_choices()
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              attention="auto")
    model.set_grad_checkpointing("all")
    x = torch.randn(6, 3, 16, 16)
    with caplog.at_level(logging.DEBUG), _autocast():
        loss = model(x).float().square().mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    picks = [r.getMessage() for r in caplog.records if "attention=auto" in r.getMessage()]
    assert len(picks) == 1 and "block stack" in picks[0] and "inf" not in picks[0], picks
    assert any("cpu_bf16_matmul=auto" in r.getMessage() for r in caplog.records)


def test_linear_residual_accumulates_in_the_gemm_and_matches_the_plain_sum():
    layer, residual, x = _residual_operands()
    with RecordedOps() as rec:
        out = layer(x, residual=residual)
    assert "addmm_" in rec.ops and "addmm" not in rec.ops  # the GEMM writes onto residual + bias
    ref = residual + layer(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (residual, x, layer.weight, layer.bias), grad)
    want = torch.autograd.grad(ref, (residual, x, layer.weight, layer.bias), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_linear_residual_falls_back_where_the_fusion_would_change_behaviour():
    layer, residual, x = _residual_operands()
    calls = []
    handle = layer.register_forward_pre_hook(lambda mod, args: calls.append(1) or (args[0] * 2,))
    torch.testing.assert_close(layer(x, residual=residual), residual + layer(x))
    assert len(calls) == 2  # a pre-hook runs (and changes the input) for the fused call too
    handle.remove()
    layer.gemm = "bf16"
    with _autocast(), RecordedOps() as rec:
        out = layer(x, residual=residual)
        assert "addmm_" not in rec.ops and out.dtype == torch.float32  # bf16 projection + fp32 residual
        torch.testing.assert_close(out, residual + layer(x))
    no_bias = Linear(6, 8, bias=False)
    with RecordedOps() as rec:
        torch.testing.assert_close(no_bias(x, residual=residual), residual + no_bias(x))
    assert "addmm_" not in rec.ops


@pytest.mark.parametrize("train", [True, False])
def test_vit_blocks_with_the_residual_in_the_gemm_match_the_unfused_blocks(monkeypatch, train):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=2, num_classes=5,
                              drop_path_rate=0.2 if not train else 0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.train(train)
    x = torch.randn(3, 3, 16, 16)

    def run():
        model.zero_grad()
        with RecordedOps() as rec:
            out = model(x)
        out.square().sum().backward()
        return out, [p.grad.clone() for p in model.parameters()], rec.ops.count("addmm_")

    fused, fused_grads, n_fused = run()
    monkeypatch.setattr(type(model.blocks[0]), "residual_in_gemm", lambda self: False)
    plain, plain_grads, n_plain = run()
    assert (n_fused, n_plain) == (4, 0)  # proj and fc2 of both blocks; drop path is inactive in eval
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_active_stochastic_depth_keeps_the_unfused_residual():
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=2, num_classes=5,
                              drop_path_rate=0.5).train()
    with RecordedOps() as rec:
        model(torch.randn(3, 3, 16, 16))
    assert rec.ops.count("addmm_") == 2  # block 0 (drop-path rate 0: rates rise from 0) fuses both; block 1 none
    seen = []
    proj = model.blocks[0].attn.proj
    proj.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    with RecordedOps() as rec:
        model.eval()(torch.randn(3, 3, 16, 16))
    assert rec.ops.count("addmm_") == 2  # block 1 fuses both; block 0, whose proj is hooked, neither
    h, out = seen[0]
    torch.testing.assert_close(out, F.linear(h, proj.weight, proj.bias))  # proj's own output, not residual + it
