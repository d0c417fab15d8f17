"""Optimizer parameter groups, the fused step, learning-rate schedules and warmup, the EMA."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import digits_config
from vitflow import create_model
from vitflow.config import build_config
from vitflow.training import Trainer
from vitflow.training.optim.ema import ModelEMA
from vitflow.training.optim.optimizers import build_optimizer, fused_supported, param_groups
from vitflow.training.optim.schedules import Schedule, build_scheduler


def test_param_groups_exclude_norms_biases_pos_and_cls():
    from vitflow import create_model

    m = create_model("vit_cifar_patch4_32", num_classes=10)
    decay, no_decay = param_groups(m, 0.05)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.bias"} <= nd
    assert all(p.ndim >= 2 for p in decay["params"]) and "pos_embed" not in {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def test_warmup_cosine_values():
    f = Schedule(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert Schedule(100, 0, "linear")(50) == pytest.approx(0.5)


def test_warmup_longer_than_the_run_is_warned(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="vitflow.training.loop"):
        Trainer(digits_config(tmp_path / "a", "train.total_steps=20", "optim.warmup_steps=10"))
        assert not caplog.records
        Trainer(digits_config(tmp_path / "b", "train.total_steps=20", "optim.warmup_steps=40"))
    msg = caplog.records[-1].getMessage()
    assert "optim.warmup_steps=40" in msg and "train.total_steps (20 steps)" in msg and "0.5 of the peak lr" in msg


def test_schedule_values_equal_the_formulas():
    cos = Schedule(total_steps=110, warmup_steps=10, kind="cosine", min_ratio=0.1)
    assert [cos(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # (s + 1) / W
    for s in (10, 37, 60, 85, 109, 110, 500):
        t = min(s - 10, 100) / 100
        assert cos(s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
    lin = Schedule(200, 0, "linear", min_ratio=0.2)
    assert [lin(s) for s in (0, 50, 150, 200, 999)] == pytest.approx([1.0, 0.8, 0.4, 0.2, 0.2])
    step = Schedule(100, 5, "step", milestones=(0.5, 80), gamma=0.1)  # a fraction and an absolute step
    assert step.milestone_steps() == [50, 80]
    assert [step(s) for s in (2, 5, 49, 50, 79, 80, 99)] == pytest.approx([0.6, 1, 1, 0.1, 0.1, 0.01, 0.01])
    assert Schedule(100, 0, "constant")(77) == 1.0
    # SGDR: decay span 700 = 100 + 200 + 400 (cycle_mult 2), peaks 1, 0.5, 0.25, floor 0.1 x peak
    sgdr = Schedule(800, 100, "restarts", min_ratio=0.1, cycles=3, cycle_mult=2.0, cycle_decay=0.5)
    starts, lengths, peaks = [100, 200, 400], [100, 200, 400], [1.0, 0.5, 0.25]
    for start, length, peak in zip(starts, lengths, peaks):
        for frac in (0.0, 0.3, 0.5, 0.99):
            s = start + round(frac * length)
            t = (s - start) / length
            assert sgdr(s) == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))), s
    assert sgdr(199) > 0.1 and sgdr(200) == pytest.approx(0.5) and sgdr(800) == pytest.approx(0.025)
    equal = Schedule(400, 0, "restarts", cycles=4)  # cycle_mult 1: four cycles of 100
    assert [equal(s) for s in (0, 50, 100, 150, 300)] == pytest.approx([1, 0.5, 1, 0.5, 1])


def test_scheduler_drives_every_group_and_layer_decay():
    model = create_model("vit_digits_patch2_8", num_classes=10, global_pool="token")  # depth 4
    cfg = build_config(overrides=["optim.lr=1e-2", "optim.layer_decay=0.5", "optim.warmup_steps=4",
                                  "optim.schedule=linear", "train.total_steps=20"])
    opt = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    scale = {names[id(p)]: g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    assert scale["head.weight"] == 1.0 and scale["norm.weight"] == 1.0
    assert scale["blocks.3.mlp.fc1.weight"] == 0.5 and scale["blocks.0.attn.qkv.bias"] == 0.5**4
    assert scale["patch_embed.proj.weight"] == scale["pos_embed"] == scale["cls_token"] == 0.5**5
    assert all(g["weight_decay"] == 0 for g in opt.param_groups if any(p.ndim == 1 for p in g["params"]))
    sched = build_scheduler(opt, cfg.optim, cfg.train.total_steps)
    fn = Schedule(20, 4, "linear")
    for s in range(12):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 * g["lr_scale"] * fn(s)
                                                                     for g in opt.param_groups])
        opt.step()
        sched.step()
    decay, no_decay = param_groups(model, 0.05)  # without layer decay: the two classic groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_optimizer_step_matches_the_per_tensor_loop(name):
    """build_optimizer's fused step (CPU) applies the same update as torch's per-tensor loop."""
    torch.manual_seed(0)
    model = create_model("vit_digits_patch2_8", num_classes=10)
    ref = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    cfg = build_config(overrides=[f"optim.name={name}", "optim.lr=1e-2"]).optim
    opt = build_optimizer(model, cfg)
    assert opt.defaults["fused"] is True
    groups = param_groups(ref, cfg.weight_decay, cfg.lr)
    ref_opt = (torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False) if name == "adamw"
               else torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True, foreach=False))
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    for _ in range(5):  # the same gradients for both: Adam magnifies last-bit differences where a
        F.cross_entropy(model(x), y).backward()  # gradient is ~0 (the key bias), so compare the step alone
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    assert max((p - p0).abs().max().item() for p, p0 in zip(model.parameters(), start)) > 1e-3  # it did train
    assert not fused_supported([])
    assert not fused_supported([torch.nn.Parameter(torch.zeros(2, dtype=torch.int32), requires_grad=False)])


def test_ema_update_math_with_and_without_warmup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ema = ModelEMA(model, decay=0.9, warmup=True)
    plain = ModelEMA(model, decay=0.9, warmup=False)
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    expect_plain = {k: v.clone() for k, v in model.state_dict().items()}
    for n in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.train()(torch.randn(8, 4))  # moves BatchNorm running stats, counts batches
        d = min(0.9, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(d)
        ema.update(model)
        plain.update(model)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                expect[k] = d * expect[k] + (1 - d) * v
                expect_plain[k] = 0.9 * expect_plain[k] + 0.1 * v
            else:
                expect[k] = expect_plain[k] = v.clone()
    for k in expect:
        torch.testing.assert_close(ema.module.state_dict()[k], expect[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(plain.module.state_dict()[k], expect_plain[k], rtol=1e-6, atol=1e-6)
    assert ema.updates == 6 and not ema.module.training
    again = ModelEMA(model, 0.9)
    again.load_state_dict(ema.state_dict())
    assert again.updates == 6 and torch.equal(again.module[0].weight, ema.module[0].weight)


def test_fitted_schedule_inside_the_warmup_is_said_once(caplog):
    """A time budget refits the schedule's length many times; a length inside the warmup is said
    once per run (a loaded machine printed it at every refit), and not for a length past the warmup."""
    from vitflow.training.plan.budget import ProgressiveResizing, TimeBudget
    from vitflow.training.scale.distributed import DistEnv

    cfg = build_config("cifar10-vit-tiny", overrides=["optim.lr=1e-3", "optim.warmup_steps=50"]).optim
    sched = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), cfg, 1000)
    budget = TimeBudget(60.0, 0.0, ProgressiveResizing(None, 224, (0.0, 0.5), 16, 1), cfg)
    fits = iter([200, 27, 29, 27, 31, 400])
    budget.fit = lambda step, max_total: next(fits)
    with caplog.at_level("WARNING", logger="vitflow"):
        for _ in range(6):
            budget.refit(sched, 5, 100000, DistEnv(), lambda: 0.1)
    assert sched.lr_lambdas[0].total_steps == 400
    said = [r.getMessage() for r in caplog.records if "inside the warmup" in r.getMessage()]
    assert said == ["optim.warmup_steps=50 is not below the time budget's fitted schedule (27 steps): the run ends "
                    "inside the warmup, at 0.54 of the peak lr 0.001"]
