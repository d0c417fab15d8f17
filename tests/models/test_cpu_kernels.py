"""vitflow's C++ CPU kernels (vitflow.models.kernels.cpp): the fused window attention against
the explicit math kernel in value and in every gradient, on the shapes Swin uses and on awkward
ones (tokens and head widths that are not multiples of 16), in float32 and bfloat16; a Swin model
on the fused backend against math; the fallbacks; the LayerNorm backward against float64."""

import logging

import pytest
import torch

from vitflow.models import create_model
from vitflow.models.attention import packed_math_attention
from vitflow.models.attention.window import MASK_VALUE, WindowFusedKernel, fused_window_attention
from vitflow.models.kernels import cpp

pytestmark = pytest.mark.skipif(not cpp.available(), reason="no C++ toolchain")


def _reference(qkv, heads, bias, nb):
    """float64 explicit attention: the bias ``(nb, H, N, N)`` shared by each image's windows."""
    n = qkv.shape[1]
    groups = qkv.shape[0] // nb
    return packed_math_attention(qkv, heads, None if bias is None else bias.reshape(nb * heads, n, n), groups)


@pytest.mark.parametrize("windows,nb,heads,n,d", [
    (8, 4, 3, 49, 32),   # Swin-T's stage 1: 7x7 windows, shifted (a bias per window slot)
    (6, 1, 2, 49, 32),   # unshifted: one bias for every window
    (4, 2, 2, 9, 24),    # 3x3 windows, head width 24: padding on both axes
    (3, 1, 1, 64, 16),   # no padding at all
    (2, 1, 4, 144, 8),   # 12x12 windows (Swin-B/384), several key vectors per row
])
def test_fused_window_attention_matches_math(windows, nb, heads, n, d):
    torch.manual_seed(0)
    qkv = torch.randn(windows, n, 3 * heads * d, dtype=torch.float64) * 2
    bias = torch.randn(nb, heads, n, n, dtype=torch.float64)
    bias[0, :, : n // 2, n // 2:] = MASK_VALUE  # masked pairs: exp underflows (to exactly 0 in the kernel)
    g = torch.randn(windows, n, heads * d, dtype=torch.float64)
    q64, b64 = qkv.clone().requires_grad_(), bias.clone().requires_grad_()
    want = _reference(q64, heads, b64, nb)
    want.backward(g)
    q32, b32 = qkv.float().requires_grad_(), bias.float().requires_grad_()
    proj_bias = torch.zeros(qkv.shape[-1], requires_grad=True)  # gets the column sums of qkv's gradient
    got = fused_window_attention(q32, heads, b32, proj_bias)
    got.backward(g.float())
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q32.grad.double(), q64.grad, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(b32.grad.double(), b64.grad, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(proj_bias.grad.double(), q64.grad.sum((0, 1)), atol=1e-4, rtol=1e-5)
    with torch.no_grad():  # the inference path (no probabilities kept) gives the same output
        torch.testing.assert_close(fused_window_attention(q32, heads, b32), got.detach(), atol=0, rtol=0)


def test_fused_window_attention_bf16_and_no_bias():
    """bfloat16 in and out (float32 arithmetic): within bf16 rounding of the float64 result; no
    bias; a bias that needs no gradient gets none."""
    torch.manual_seed(1)
    qkv = torch.randn(16, 49, 3 * 3 * 32, dtype=torch.float64)
    want = _reference(qkv, 3, None, 1)
    got = fused_window_attention(qkv.bfloat16(), 3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    bias = torch.zeros(1, 3, 49, 49)
    q = qkv.bfloat16().requires_grad_()
    fused_window_attention(q, 3, bias).sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad.float()).all() and bias.grad is None


def test_swin_on_the_fused_backend_matches_math():
    """A Swin with 7x7 windows (shifted blocks in two stages): logits and every gradient, the qkv
    biases' (summed by the kernels) equal to the projection's own backward's."""
    torch.manual_seed(0)
    model = create_model("swin_tiny_patch4_window7_224", img_size=56, patch_size=2, embed_dim=32,
                         depths=(2, 2), num_heads=(2, 4), num_classes=5)
    x = torch.randn(2, 3, 56, 56)

    def run(backend):
        model.set_attention_backend(backend)
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    results = {backend: run(backend) for backend in ("math", "fused")}
    assert isinstance(model.blocks[1].attn.kernel, WindowFusedKernel) and any(model.blocks[1].shift)
    # the qkv bias's gradient from the projection's own backward (a hook keeps the kernels out of it)
    hooks = [blk.attn.qkv.register_forward_hook(lambda *a: None) for blk in model.blocks]
    results["plain"] = run("math")
    for h in hooks:
        h.remove()
    for other in ("fused", "plain"):
        torch.testing.assert_close(results[other][0], results["math"][0], atol=1e-5, rtol=1e-5)
        for n, g in results["math"][1].items():
            torch.testing.assert_close(results[other][1][n], g, atol=1e-5, rtol=1e-4, msg=n)
    assert results["fused"][1]["layers.0.blocks.0.attn.qkv.bias"].abs().max() > 0


def test_fused_kernel_falls_back_where_it_does_not_apply():
    """float64, attention dropout: the math kernel's result, not an error."""
    from vitflow.models.attention.window import WindowContext, WindowMathKernel

    torch.manual_seed(0)
    qkv = torch.randn(4, 16, 3 * 2 * 8, dtype=torch.float64)
    ctx = WindowContext((4, 4), 0, torch.zeros(1, 2, 16, 16, dtype=torch.float64), 0.0, None)
    torch.testing.assert_close(WindowFusedKernel()(qkv, 2, ctx), WindowMathKernel()(qkv, 2, ctx))


def test_unavailable_kernels_say_why(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="vitflow")  # whatever level an earlier in-process command left
    monkeypatch.setattr(cpp, "_STATE", {})
    monkeypatch.setenv("VITFLOW_CPU_KERNELS", "0")
    assert not cpp.available()
    assert "VITFLOW_CPU_KERNELS=0" in caplog.text
    with pytest.raises(RuntimeError, match="unavailable"):
        cpp.ops()


@pytest.mark.parametrize("dtype,cols", [(torch.float32, 96), (torch.float32, 40), (torch.float32, 36), (torch.bfloat16, 96)])
def test_layer_norm_backward_kernel_matches_float64(dtype, cols):
    """vitflow's LayerNorm (one-pass backward) against float64 nn.LayerNorm on the same input
    values: input gradient to the dtype's rounding, weight and bias gradients to float32 summation
    (for bf16 inputs too: PyTorch's CPU kernel sums those two far less exactly there); a permuted
    (non-contiguous) input as Swin's patch embedding gives it."""
    from vitflow.models.layers import LayerNorm

    torch.manual_seed(0)
    norm = LayerNorm(cols)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = (torch.randn(3, cols, 10, 10) * 2 + 1).to(dtype).permute(0, 2, 3, 1)  # (B, H, W, C), not contiguous
    g = torch.randn(3, 10, 10, cols).to(dtype)
    xd = x.double().requires_grad_()
    w, b = norm.weight.double().requires_grad_(), norm.bias.double().requires_grad_()
    ref = torch.nn.functional.layer_norm(xd, (cols,), w, b, norm.eps)
    dx_ref, dw_ref, db_ref = torch.autograd.grad(ref, (xd, w, b), g.double())
    xi = x.detach().requires_grad_()
    out = norm(xi)
    out.backward(g)
    assert out.dtype == dtype and xi.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(xi.grad.double(), dx_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(norm.weight.grad.double(), dw_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(norm.bias.grad.double(), db_ref, atol=1e-4, rtol=1e-5)


def test_kernels_are_built_at_construction_never_in_a_forward(monkeypatch):
    """A fresh process state: building a Swin loads the kernels; its first training forward and backward
    (fused attention, vitflow's LayerNorm backward) find them ready and never build."""
    monkeypatch.setattr(cpp, "_STATE", {})
    model = create_model("swin_cifar_patch2_window4_32", attention="fused", num_classes=3, embed_dim=24,
                         depths=(1, 1), num_heads=(1, 2))
    assert cpp._STATE == {"ok": True}

    def no_build():
        raise AssertionError("the kernels were built inside a forward")

    monkeypatch.setattr(cpp, "_build", no_build)
    monkeypatch.setattr(cpp, "_STATE", {})  # would make a forward build again, were it to ask
    cpp._STATE["ok"] = True  # what construction left
    model(torch.rand(2, 3, 32, 32)).sum().backward()


@pytest.mark.parametrize("cols,branch_dtype", [(192, torch.bfloat16), (200, torch.float32), (7, torch.bfloat16),
                                               (96, None)])
def test_add_layer_norm_kernel_matches_pytorch(cols, branch_dtype):
    """The fused residual add + LayerNorm of bf16 inference: the float32 sum bit for bit, the bf16
    LayerNorm within one bf16 rounding of float64's, and equal to PyTorch's float32 LayerNorm rounded
    to bf16 on all but a few elements (the order of the float32 sums differs); rows of 7 and 200:
    the vector loops' tails."""
    from vitflow.models.kernels.norm import add_layer_norm

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(cols, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = torch.randn(300, cols) * 3 + 1
    branch = None if branch_dtype is None else torch.randn(300, cols).to(branch_dtype)
    with torch.no_grad():
        s, y = add_layer_norm(x, branch, norm)
        summed = x if branch is None else x + branch
        torch_y = norm(summed).bfloat16()
    assert torch.equal(s, summed) and (branch is not None or s.data_ptr() == x.data_ptr())
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    exact = torch.nn.functional.layer_norm(summed.double(), (cols,), norm.weight.double(), norm.bias.double(), norm.eps)
    torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-6)
    assert (y != torch_y).float().mean() < 1e-3


@pytest.mark.parametrize("branch_dtype", [torch.bfloat16, torch.float32, None])
def test_add_layer_norm_gradients_match_autograd(branch_dtype):
    """The fused kernel's backward against autograd through ``x + branch`` and float32 LayerNorm: the
    gradient reaching the sum from its other use (``gs``) and the LayerNorm's are added, the
    branch's is that sum rounded to its dtype, the weight and bias gradients to float32 summation."""
    from vitflow.models.kernels.norm import add_layer_norm

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(200, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    x = (torch.randn(64, 200) * 2 + 1).requires_grad_()
    branch = None if branch_dtype is None else torch.randn(64, 200).to(branch_dtype).requires_grad_()
    gy, gs = torch.randn(64, 200).bfloat16(), torch.randn(64, 200)

    def grads(fused: bool):
        for t in (x, branch, norm.weight, norm.bias):
            if t is not None:
                t.grad = None
        if fused:
            s, y = add_layer_norm(x, branch, norm)
        else:
            s = x if branch is None else x + branch
            y = norm(s)
        assert y.dtype == (torch.bfloat16 if fused else torch.float32)
        ((y.float() * gy.float()).sum() + (s * gs).sum()).backward()
        return [None if t is None else t.grad.clone() for t in (x, branch, norm.weight, norm.bias)]

    fused, plain = grads(True), grads(False)
    torch.testing.assert_close(fused[0], plain[0], atol=1e-4, rtol=1e-4)
    if branch is not None:
        assert fused[1].dtype == branch_dtype
        torch.testing.assert_close(fused[1], plain[1], atol=1e-2 if branch_dtype == torch.bfloat16 else 1e-4,
                                   rtol=1e-2 if branch_dtype == torch.bfloat16 else 1e-4)
    torch.testing.assert_close(fused[2], plain[2], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(fused[3], plain[3], atol=1e-3, rtol=1e-4)


def test_vit_bf16_fuses_add_and_norm_and_matches_the_plain_blocks(monkeypatch):
    """A ViT under bf16 autocast on the CPU runs each block's two LayerNorms through the fused kernel
    (each block's last add in the next block's first norm) and gives the unfused blocks' logits
    (inference) and parameter gradients (training) to bf16 rounding; a hooked block runs its own
    forward, a block whose norm has a hook (feature extraction) keeps PyTorch's LayerNorm."""
    from vitflow.models.block import Blocks
    from vitflow.models.kernels import norm as norm_kernel

    fused_chain = Blocks._fused_chain
    torch.manual_seed(0)
    model = create_model("vit_cifar_patch4_32", num_classes=10, depth=3).eval()
    x, labels = torch.randn(8, 3, 32, 32), torch.arange(8) % 10
    calls = []
    fused_call = norm_kernel.add_layer_norm
    monkeypatch.setattr(norm_kernel, "add_layer_norm", lambda *a: calls.append(1) or fused_call(*a))

    def logits():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float()

    def gradients():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.cross_entropy(model.train()(x), labels).backward()
        model.eval()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    fused, fused_grads = logits(), gradients()
    assert len(calls) == 2 * (2 * 3)
    with monkeypatch.context() as m:
        m.setattr(norm_kernel, "fusable", lambda *a: False)
        plain, plain_grads = logits(), gradients()
    torch.testing.assert_close(fused, plain, atol=0.05, rtol=0.02)
    assert fused.std() > 0.1  # logits of a random model, not zeros
    for name, g in plain_grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(fused_grads[name], g, atol=2e-2 * g.abs().max().item(), rtol=0.05, msg=name)
    chained = []  # the blocks' chain: each block's last add in the next block's first norm
    monkeypatch.setattr(Blocks, "_fused_chain", lambda self, *a: chained.append(1) or fused_chain(self, *a))
    calls.clear()
    logits()
    assert chained and len(calls) == 2 * 3
    seen = []  # a hooked block: every block runs its own forward, the hooked one sees its output
    hook = model.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    chained.clear(), calls.clear()
    torch.testing.assert_close(logits(), fused, atol=0.05, rtol=0.02)
    assert seen == [(8, 65, 192)] and not chained and len(calls) == 2 * 3
    hook.remove()
    model.blocks[1].norm2.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    calls.clear()
    logits()
    assert seen[-1] == (8, 65, 192) and not chained and len(calls) == 2 * 2
