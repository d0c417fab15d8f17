"""oneDNN's fp32 GEMM for linear layers (vitflow.models.kernels.onednn): values and gradients against
float64, which calls go to it, the timed choice."""

import logging

import pytest
import torch
import torch.nn.functional as F

from helpers import RecordedOps
from vitflow.models.kernels import onednn
from vitflow.models.kernels.matmul import Linear, linear_fp32_gemm
from vitflow.models.vit.model import VisionTransformer

pytestmark = pytest.mark.skipif(not onednn.AVAILABLE, reason="PyTorch without oneDNN")


def _operands(shape, n, bias, residual, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n, shape[-1], generator=g) * shape[-1] ** -0.5
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(*shape[:-1], n, generator=g) if residual else None
    return [t if t is None else t.requires_grad_() for t in (x, w, b, r)]


def _value_and_grads(fn, tensors, grad):
    out = fn(*tensors)
    inputs = [t for t in tensors if t is not None]
    return [out, *torch.autograd.grad(out, inputs, grad.to(out.dtype))]


@pytest.mark.parametrize("shape,bias,residual", [((37, 48), True, False), ((3, 50, 64), True, True),
                                                 ((3, 50, 64), False, True), ((2, 7, 96), False, False)])
def test_linear_onednn_matches_float64_in_value_and_every_gradient(shape, bias, residual):
    tensors = _operands(shape, 40, bias, residual)
    grad = torch.randn(*shape[:-1], 40, generator=torch.Generator().manual_seed(1))
    got = _value_and_grads(onednn.linear_onednn, tensors, grad)
    wide = [t if t is None else t.detach().double().requires_grad_() for t in tensors]
    want = _value_and_grads(lambda x, w, b, r: F.linear(x, w, b) + (0 if r is None else r), wide, grad)
    assert len(got) == len(want) == 3 + bias + residual
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-6 * b.abs().max().item())


def test_its_output_may_be_modified_in_place():
    """oneDNN returns a 3-D input's output as a view; made inside a custom autograd function, such a
    view may not be modified in place (a RuntimeError in Swin's blocks before the fix)."""
    x, w, b, _ = _operands((2, 9, 16), 8, True, False)
    y = onednn.linear_onednn(x, w, b)
    y.mul_(2)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (2 * w.sum(0)).expand(2, 9, 16), rtol=1e-6, atol=1e-6)


def test_a_second_derivative_raises_instead_of_a_silently_wrong_one():
    x, w, b, _ = _operands((5, 16), 8, True, False)
    (gx,) = torch.autograd.grad(onednn.linear_onednn(x, w, b).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="twice|double backward|once_differentiable"):
        gx.sum().backward()


def test_large_fp32_layers_run_on_the_chosen_gemm_small_ones_and_traced_ones_on_torch():
    torch.manual_seed(0)
    layer, small = Linear(256, 512), Linear(8, 4)
    x = torch.randn(4, 64, 256, requires_grad=True)  # 256 x 256 x 512: 33.5M multiply-adds, above MIN_MACS
    residual = torch.randn(4, 64, 512)
    assert 256 * 256 * 512 >= onednn.MIN_MACS > 4 * 8 * 8 * 4
    with onednn.forced("onednn"), RecordedOps() as rec:
        y = layer(x, residual)
        y.sum().backward()
        small(torch.randn(4, 8))
    assert rec.ops.count("_linear_pointwise") == 2  # forward (residual added inside) and input gradient
    assert rec.ops.count("addmm") == 1 and "add" not in rec.ops  # the small layer; no separate residual add
    torch.testing.assert_close(y, residual + F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with onednn.forced("torch"), RecordedOps() as rec:
        layer(x)
    assert "_linear_pointwise" not in rec.ops and "addmm" in rec.ops
    with onednn.forced("onednn"):
        graph = torch.export.export(layer, (x.detach(),)).graph_module.code
    assert "mkldnn" not in graph and "linear" in graph  # traced for export: the plain op


def test_a_frozen_weight_keeps_no_input_and_transforms_and_disabled_onednn_use_torch(monkeypatch):
    """Saved for backward: only what the wanted gradients read (a frozen layer, as in LoRA or
    partial freezing, keeps its weight, not its input). ``torch.func`` transforms and
    ``torch.backends.mkldnn.enabled = False`` take PyTorch's path."""
    layer = Linear(256, 512).requires_grad_(False)
    x = torch.randn(4, 64, 256, requires_grad=True)
    saved = []
    with onednn.forced("onednn"), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                           lambda t: t):
        layer(x).sum().backward()
    assert [tuple(t.shape) for t in saved] == [(512, 256)]
    params = dict(layer.named_parameters())
    with onednn.forced("onednn"), RecordedOps() as rec:
        grads = torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x.detach(),)).sum())(params)
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
        layer(x)
    assert "_linear_pointwise" not in rec.ops
    torch.testing.assert_close(grads["bias"], torch.full((512,), 256.0))


def test_bf16_layers_multiplying_in_fp32_use_the_chosen_gemm():
    """``cpu_bf16_matmul=fp32``'s products go through oneDNN too, with the same result: the exact
    product of the bf16-rounded operands rounded once to bf16; the input gradient to fp32 accuracy."""
    x, w, b, _ = _operands((300, 256), 384, True, False)
    x16, w16, b16 = (t.detach().bfloat16().double() for t in (x, w, b))
    exact = F.linear(x16, w16, b16)
    upstream = torch.randn(exact.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    for mode, pointwise in (("onednn", 2), ("torch", 0)):
        with onednn.forced(mode), RecordedOps() as rec:
            y = linear_fp32_gemm(x, w, b)
            (gx,) = torch.autograd.grad(y, x, upstream)
        assert rec.ops.count("_linear_pointwise") == pointwise
        assert ((y.double() - exact).abs() <= exact.abs().clamp_min(1e-3) * 2.0**-7).all()  # one bf16 step
        torch.testing.assert_close(gx.double(), upstream.double() @ w16, rtol=1e-5, atol=1e-5)


def test_a_vit_trains_through_onednn_as_closely_to_float64_as_through_torch():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, patch_size=8, embed_dim=192, depth=2, num_heads=3, num_classes=10,
                              attention="math")
    x = torch.randn(4, 3, 64, 64)

    def step(m, inputs):
        m.zero_grad()
        with RecordedOps() as rec:
            out = m(inputs)
            out.square().mean().backward()
        return out, [p.grad for p in m.parameters()], rec.ops.count("_linear_pointwise")

    results = {}
    for mode in ("onednn", "torch"):
        with onednn.forced(mode):
            results[mode] = step(model, x)
    ref_out, ref_grads, _ = step(model.double(), x.double())
    assert results["onednn"][2] == 2 * 2 * 4 and results["torch"][2] == 0  # qkv, proj, fc1, fc2: forward + dx

    def error(out, grads):
        return max([(out - ref_out).abs().max() / ref_out.abs().max()]
                   + [(g - r).abs().max() / r.abs().max() for g, r in zip(grads, ref_grads)]).item()

    errors = {mode: error(*results[mode][:2]) for mode in results}
    assert errors["onednn"] < 1e-5 and errors["onednn"] < 4 * errors["torch"], errors


def test_auto_times_once_and_logs_the_choice(caplog):
    with onednn.forced("auto"), caplog.at_level(logging.DEBUG, logger="vitflow.models.kernels.onednn"):
        first, second = onednn.fp32_gemm(), onednn.fp32_gemm()
    lines = [r.getMessage() for r in caplog.records]
    assert first == second in ("onednn", "torch") and len(lines) == 1
    assert lines[0].startswith(f"fp32 linear layers: {first} GEMM (ms for (1024 x 768) @ (768 x 3072)")
    with pytest.raises(ValueError, match="fp32 GEMM must be one of auto, onednn, torch, got 'mkl'"):
        onednn.set_fp32_gemm("mkl")


def test_the_environment_sets_the_mode_and_a_bad_value_is_named(tmp_path):
    """VITFLOW_FP32_GEMM forces the GEMM of a process (and of everything it starts); a typo fails the
    run with one line naming the variable."""
    import subprocess
    import sys

    from helpers import ENV

    probe = ("import logging; logging.basicConfig(level=logging.DEBUG, format='%(message)s'); "
             "from vitflow.models.kernels import onednn; print(onednn.fp32_gemm())")
    for value, mode in (("torch", "torch"), ("ONEDNN", "onednn")):
        out = subprocess.run([sys.executable, "-c", probe], env={**ENV, onednn.ENV_VAR: value}, capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip() == mode and f"fp32 linear layers: {mode} GEMM (VITFLOW_FP32_GEMM)" in out.stderr
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "vitflow", "train", "train.total_steps=1", f"train.run_dir={run}"],
                         env={**ENV, onednn.ENV_VAR: "mkl"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and not run.exists()  # refused before the run folder is made
    assert out.stderr.strip().splitlines()[-1] == "error: VITFLOW_FP32_GEMM must be one of auto, onednn, torch, got 'mkl'"


def test_every_rank_takes_rank_0s_fp32_gemm(monkeypatch):
    """Under torchrun on a CPU each rank would time on its own (at once, on shared cores) and could
    pick the other GEMM: the choice is made at start-up while every rank is there and rank 0's is
    taken (vitflow.timing's agreement; here a rank 1 that timed 'onednn' and whose broadcast hands
    it rank 0's 'torch')."""
    from vitflow import timing
    from vitflow.training.scale.distributed import DistEnv, run_precision

    class Rank1(DistEnv):
        def broadcast(self, obj):
            assert obj == "onednn"  # its own choice, replaced by rank 0's
            return "torch"

    monkeypatch.setattr(onednn, "_time_gemms", lambda: "onednn")
    rank1 = Rank1(rank=1, world_size=2)
    timing.forget(onednn.KIND)
    timing.set_agreement(rank1.broadcast)
    try:
        with onednn.forced("auto"):
            run_precision("fp32", torch.device("cpu"), rank1)
            assert onednn.decided() == "torch"
    finally:
        timing.set_agreement(None)
        timing.forget(onednn.KIND)


def test_evaluating_a_checkpoint_takes_its_runs_gemm_unless_the_process_chose_one(digits_run, tmp_path, monkeypatch):
    """`vitflow eval` rounds as the run's own evaluation did: the checkpoint's fp32_gemm inside
    (the process's auto choice back after it); VITFLOW_FP32_GEMM or set_fp32_gemm win."""
    from vitflow.checkpoint import load_checkpoint, save_checkpoint
    from vitflow.infer.evaluate import evaluate_checkpoint

    run, r, _ = digits_run
    state = load_checkpoint(run)
    paths = {}
    for gemm in ("onednn", "torch"):
        paths[gemm] = save_checkpoint({**state, "fp32_gemm": gemm}, tmp_path / f"{gemm}.pt")
    monkeypatch.delenv(onednn.ENV_VAR, raising=False)
    monkeypatch.setattr(onednn, "_STATE", {"mode": None, "choice": "torch"})  # a process whose auto chose torch
    for gemm, expected in (("onednn", True), ("torch", False)):
        with RecordedOps() as rec:
            result = evaluate_checkpoint(paths[gemm])
        assert ("_linear_pointwise" in rec.ops) is expected, gemm
        assert result["test_top1"] == pytest.approx(r["test_top1"], abs=1 / 359)
        assert onednn._STATE == {"mode": None, "choice": "torch"}  # the process's own choice again
    monkeypatch.setenv(onednn.ENV_VAR, "torch")  # the user's choice wins over the run's
    with RecordedOps() as rec:
        evaluate_checkpoint(paths["onednn"])
    assert "_linear_pointwise" not in rec.ops
