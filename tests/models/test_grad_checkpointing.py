import logging

import pytest
import torch

import vitflow
from vitflow.models.grad_checkpointing import CheckpointPlan, parse_bytes, plan_auto, saved_activation_bytes


def checkpointed(model) -> set[int]:
    """The blocks the model's last forward recomputes in the backward pass."""
    return {i for i, blk in enumerate(model.blocks) if blk.grad_checkpointing}


def grads(model, x):
    model.zero_grad()
    torch.manual_seed(123)  # dropout / drop-path masks drawn identically in both runs
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("spec", [True, "every:2", [1, 3], "auto"])
def test_checkpointed_blocks_give_the_same_gradients(spec):
    torch.manual_seed(0)
    m = vitflow.create_model("vit_cifar_patch4_32", depth=4, num_classes=10, drop_rate=0.1, drop_path_rate=0.2,
                             attention="math").train()
    x = torch.randn(2, 3, 32, 32)
    plain = grads(m, x)
    m.set_grad_checkpointing(spec, memory_budget="1MiB")
    with_ckpt = grads(m, x)
    assert checkpointed(m)  # something was checkpointed
    for a, b in zip(plain, with_ckpt):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_plans_select_the_requested_blocks():
    assert CheckpointPlan.parse(False).blocks(9) == frozenset()
    assert CheckpointPlan.parse("all").blocks(4) == {0, 1, 2, 3}
    assert CheckpointPlan.parse("every:3").blocks(9) == {0, 3, 6}
    assert CheckpointPlan.parse("0, 5").blocks(9) == {0, 5}
    assert CheckpointPlan.parse("True").blocks(2) == {0, 1}  # a YAML true read as a string
    with pytest.raises(ValueError, match="out of range"):
        CheckpointPlan.parse([12]).blocks(9)
    with pytest.raises(ValueError, match="budget"):
        CheckpointPlan.parse("auto")
    with pytest.raises(ValueError, match="every:K"):
        CheckpointPlan.parse("sometimes")
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("512MiB") == 2**29 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_plan_auto_takes_the_fewest_blocks_that_fit():
    # 12 blocks of 100 MiB each, 10 MiB input per checkpointed block
    mib = 2**20
    assert plan_auto(12, 100 * mib, 10 * mib, 2000 * mib) == 0
    k = plan_auto(12, 100 * mib, 10 * mib, 700 * mib)
    assert (12 - k) * 100 + k * 10 <= 700 < (12 - (k - 1)) * 100 + (k - 1) * 10
    assert plan_auto(12, 100 * mib, 10 * mib, 50 * mib) == 12


def test_auto_checkpointing_fits_the_budget_measured(caplog):
    torch.manual_seed(0)
    m = vitflow.create_model("vit_cifar_patch4_32", depth=6, num_classes=10, attention="math").train()
    x = torch.randn(8, 3, 32, 32)
    params = list(m.parameters())
    full = saved_activation_bytes(lambda: m(x), exclude=params)
    budget = full // 2
    m.set_grad_checkpointing("auto", memory_budget=budget)
    with caplog.at_level(logging.INFO, logger="vitflow.models.grad_checkpointing"):
        reduced = saved_activation_bytes(lambda: m(x), exclude=params)
    chosen = checkpointed(m)
    assert 0 < len(chosen) < len(m.blocks)
    assert reduced <= budget * 1.1 < full  # blocks' activations within budget (embed/head outside it)
    assert any("grad checkpointing auto" in r.getMessage() for r in caplog.records)
    m.set_grad_checkpointing("auto", memory_budget=full * 2)
    m(x)
    assert not checkpointed(m)


def test_config_reaches_the_model_checkpointing():
    from vitflow.config import ConfigError, build_config
    from vitflow.models import check_config

    cfg = build_config(overrides=["model.grad_checkpointing=every:2"])
    assert cfg.model.grad_checkpointing == "every:2"
    assert checkpointed(vitflow.create_model(**vitflow.models.model_args(cfg.model, 10))) == {0, 2}
    with pytest.raises(ConfigError, match="grad_checkpointing"):
        build_config(overrides=["model.grad_checkpointing=auto"], checks={"model": check_config})
    cfg = build_config(overrides=["model.grad_checkpointing=auto", "model.grad_checkpointing_budget=1GiB"])
    assert CheckpointPlan.parse(cfg.model.grad_checkpointing, cfg.model.grad_checkpointing_budget).budget == 2**30
