"""LoRA adapters (models/lora.py): the layer's math, matching by module name, merging into plain
weights, and the adapter size on ViT-S/16."""

import pytest
import torch
import torch.nn as nn

from vitflow import create_model
from vitflow.models.kernels.matmul import Linear
from vitflow.models.lora import (
    LoRALinear,
    apply_lora,
    has_lora_weights,
    merge_lora,
    merge_lora_state_dict,
    split_lora_args,
)


def _randomise_adapters(model: nn.Module, seed: int = 1) -> None:
    """B starts at zero (the adapted model equals the base one): give it values, as training would."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            with torch.no_grad():
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)


def test_lora_linear_is_base_plus_scaled_low_rank_update_and_starts_equal():
    torch.manual_seed(0)
    base = Linear(12, 20)
    x, res = torch.randn(3, 5, 12), torch.randn(3, 5, 20)
    reference = base(x)
    lora = LoRALinear(base, rank=4, alpha=8.0)
    assert lora.weight is base.weight and lora.bias is base.bias  # shared, not copied
    assert torch.equal(lora(x), reference)  # B = 0: the adapted layer starts as the base layer
    bound = 1 / 12 ** 0.5  # Kaiming-uniform(a=sqrt(5)) of a (4, 12) weight: U(-1/sqrt(in), 1/sqrt(in))
    assert lora.lora_A.abs().max() <= bound and lora.lora_A.std() > bound / 4
    with torch.no_grad():
        lora.lora_B.normal_()
    expected = x @ (base.weight + 2.0 * lora.lora_B @ lora.lora_A).T + base.bias
    torch.testing.assert_close(lora(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora(x, residual=res), expected + res, atol=1e-5, rtol=1e-5)
    merged = lora.merged()
    assert type(merged) is Linear and not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(merged(x), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rank >= 1"):
        LoRALinear(base, rank=0, alpha=1.0)


def test_lora_dropout_acts_on_the_adapter_branch_only_in_training():
    torch.manual_seed(0)
    lora = LoRALinear(Linear(8, 8), rank=2, alpha=2.0, dropout=0.5)
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(4, 8)
    lora.eval()
    assert torch.equal(lora(x), lora(x))
    lora.train()
    assert not torch.equal(lora(x), lora(x))


def test_apply_lora_matches_modules_by_name_and_merge_gives_the_same_outputs():
    torch.manual_seed(0)
    model = create_model("vit_digits_patch2_8", num_classes=10).eval()
    x = torch.randn(2, 3, 8, 8)
    before = model(x)
    names = apply_lora(model, rank=4, alpha=8.0, targets=("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    depth = len(model.blocks)
    assert len(names) == 4 * depth and "blocks.0.attn.qkv" in names and "blocks.3.mlp.fc2" in names
    assert isinstance(model.blocks[0].attn.qkv, LoRALinear) and not isinstance(model.head, LoRALinear)
    torch.testing.assert_close(model(x), before, atol=1e-6, rtol=1e-6)  # B = 0 (the residual add is no longer fused)
    _randomise_adapters(model)
    adapted = model(x)
    assert (adapted - before).abs().max() > 1e-3  # the adapters now change the outputs
    state = model.state_dict()
    assert has_lora_weights(state) and "blocks.2.attn.proj.lora_A" in state and "blocks.2.attn.proj.weight" in state
    folded = merge_lora_state_dict(state, alpha=8.0)  # what a weights loader does with such a checkpoint
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert folded.keys() == model.state_dict().keys()
    assert all(torch.allclose(folded[k], v, atol=1e-7) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(x), adapted, atol=1e-5, rtol=1e-5)
    plain = create_model("vit_digits_patch2_8", num_classes=10).eval()
    plain.load_state_dict(model.state_dict())  # strict: the merged model is an ordinary one of its family
    torch.testing.assert_close(plain(x), adapted, atol=1e-5, rtol=1e-5)


def test_apply_lora_by_pattern_on_any_module_tree_and_a_clear_error_when_nothing_matches():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(6, 18), nn.Linear(6, 6)

    class Other(nn.Module):  # not a vitflow class: matched by module name alone
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"attn": Attn()}) for _ in range(3)])

    m = Other()
    assert apply_lora(m, rank=2, alpha=2.0, targets=("layers.[12].attn.qkv",)) == ["layers.1.attn.qkv",
                                                                                    "layers.2.attn.qkv"]
    assert type(m.layers[0]["attn"].qkv) is nn.Linear and isinstance(m.layers[1]["attn"].qkv, LoRALinear)
    assert apply_lora(m, rank=2, alpha=2.0, targets=("attn.proj",)) == [f"layers.{i}.attn.proj" for i in range(3)]
    with pytest.raises(ValueError, match=r"match no linear layer .*blocks\.0\.attn\.qkv"):
        apply_lora(create_model("vit_digits_patch2_8"), targets=("attn.q_proj",))


def test_split_lora_args():
    args, lora = split_lora_args({"name": "x", "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["a"]}})
    assert args == {"name": "x"} and lora["rank"] == 4
    assert split_lora_args({"name": "x"}) == ({"name": "x"}, None)
    with pytest.raises(ValueError, match="unknown keys"):
        split_lora_args({"name": "x", "lora": {"rnak": 4}})


def test_lora_share_of_vit_small_patch16_224():
    """Rank 8 on qkv and proj of ViT-S/16 (12 blocks, width 384): 12 * 8 * ((384 + 1152) + (384 + 384))
    adapter weights = 221,184; with a 10-class head 225,034 of 21.9M parameters train (~1%)."""
    model = create_model("vit_small_patch16_224", num_classes=10)
    total_base = sum(p.numel() for p in model.parameters())
    apply_lora(model, rank=8, alpha=16.0)
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B")))
    assert adapters == 12 * 8 * ((384 + 1152) + (384 + 384)) == 221_184
    head = model.head.weight.numel() + model.head.bias.numel()
    share = (adapters + head) / (total_base + adapters)
    assert head == 3850 and 0.009 < share < 0.011
