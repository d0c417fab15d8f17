import pytest
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT  # noqa: E402

import vitflow
from vitflow.models import MODELS
from vitflow.models.pretrained.weights import load_pretrained, read_state_dict, save_safetensors
from vitflow.models.vit.model import resample_pos_embed

timm = pytest.importorskip("timm")


def timm_of(name: str, num_classes: int = 1000, **kw) -> torch.nn.Module:
    cfg = MODELS[name]
    return TimmViT(img_size=cfg["img_size"], patch_size=cfg["patch_size"], embed_dim=cfg["embed_dim"],
                   depth=cfg["depth"], num_heads=cfg["num_heads"], mlp_ratio=cfg.get("mlp_ratio", 4.0),
                   num_classes=num_classes, **kw).eval()


@pytest.mark.parametrize("name,num_classes", [("vit_tiny_patch16_224", 1000), ("vit_cifar_patch4_32", 10),
                                              ("vit_tiny_patch4_32", 10)])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_timm_state_dict_loads_strict_and_logits_match(name, num_classes, attention):
    torch.manual_seed(0)
    ref = timm_of(name, num_classes)
    ours = vitflow.create_model(name, num_classes=num_classes, attention=attention).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    size = MODELS[name]["img_size"]
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        expected, got = ref(x), ours(x)
    assert got.shape == (3, num_classes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert expected.std() > 1e-3  # not a degenerate comparison


def test_avg_pool_variant_matches_timm_layout():
    torch.manual_seed(0)
    ref = timm_of("vit_cifar_patch4_32", 10, global_pool="avg", class_token=False)
    ours = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, global_pool="avg").eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_tokens_stay_contiguous_without_a_class_token():
    """Without a class token no cat re-lays the patch tokens out: left in the convolution's (B, D, N)
    order, every residual add keeps that order and every LayerNorm copies its input (SigLIP's bf16
    training step spent ~5% on those copies)."""
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, global_pool="avg")
    seen = []
    for mod in m.modules():
        if isinstance(mod, torch.nn.LayerNorm):
            mod.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert m.cls_token is None and len(seen) == 2 * len(m.blocks) + 1 and all(seen)


def test_forward_features_and_head_shapes():
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=7).eval()
    tokens = m.forward_features(torch.randn(2, 3, 32, 32))
    assert tokens.shape == (2, 65, 192)
    assert m.forward_head(tokens).shape == (2, 7)
    assert m.forward_head(tokens, pre_logits=True).shape == (2, 192)


def test_registry_has_paper_sizes():
    names = vitflow.list_models()
    for size in ("tiny", "small", "base", "large", "huge"):
        for patch in (16, 32):
            assert f"vit_{size}_patch{patch}_224" in names
    assert (MODELS["vit_base_patch16_224"]["embed_dim"], MODELS["vit_base_patch16_224"]["depth"],
            MODELS["vit_base_patch16_224"]["num_heads"]) == (768, 12, 12)
    assert (MODELS["vit_large_patch16_224"]["embed_dim"], MODELS["vit_large_patch16_224"]["depth"]) == (1024, 24)
    assert (MODELS["vit_huge_patch32_224"]["embed_dim"], MODELS["vit_huge_patch32_224"]["depth"]) == (1280, 32)
    assert vitflow.list_models("vit_small_*", family="vit") == ["vit_small_patch16_224", "vit_small_patch32_224",
                                                                "vit_small_patch4_32"]
    assert "vit_small_patch14_reg4_dinov2" in vitflow.list_models("vit_small_*")  # the dinov2 family's
    with pytest.raises(ValueError, match="vit_tiny_patch16_224"):
        vitflow.create_model("vit_tiny_patch16_244")


def test_pretrained_safetensors_roundtrip_head_reset_and_pos_resample(tmp_path):
    torch.manual_seed(0)
    src = vitflow.create_model("vit_cifar_patch4_32", num_classes=10).eval()
    path = tmp_path / "w.safetensors"
    save_safetensors(src, path)
    same = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, pretrained=path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(same(x), src(x))
    # new class count: head re-initialised, everything else loaded
    other = vitflow.create_model("vit_cifar_patch4_32", num_classes=3, pretrained=path)
    assert torch.equal(other.blocks[3].mlp.fc1.weight, src.blocks[3].mlp.fc1.weight)
    assert other.head.weight.shape == (3, 192)
    # new resolution: position embedding resampled bicubically from 8x8 to 12x12
    big = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, img_size=48, pretrained=path)
    assert big.pos_embed.shape == (1, 145, 192)
    assert torch.equal(big.pos_embed[:, 0], src.pos_embed[:, 0])  # class-token position kept
    with torch.no_grad():
        assert torch.isfinite(big(torch.randn(1, 3, 48, 48))).all()


def test_resample_pos_embed_identity_and_smooth():
    grid = torch.linspace(0, 1, 4).view(1, 4, 1).expand(4, 4, 1)  # a ramp along x, constant along y
    pe = torch.cat([torch.zeros(1, 1, 1), grid.reshape(1, 16, 1)], dim=1)
    assert resample_pos_embed(pe, (4, 4)) is pe
    up = resample_pos_embed(pe, (8, 8))[0, 1:, 0].view(8, 8)
    assert torch.allclose(up[0], up[5])  # still constant along y
    assert (up[:, 1:] >= up[:, :-1] - 1e-6).all()  # still increasing along x


def test_read_state_dict_rejects_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "evil.pt"
    torch.save({"model": Evil()}, bad)
    with pytest.raises(ValueError, match="evil.pt"):
        read_state_dict(bad)
    with pytest.raises(FileNotFoundError):
        read_state_dict(tmp_path / "missing.safetensors")


def test_load_pretrained_names_mismatched_keys(tmp_path):
    small = vitflow.create_model("vit_cifar_patch4_32", num_classes=10)
    path = tmp_path / "w.safetensors"
    save_safetensors(small, path)
    wide = vitflow.create_model("vit_tiny_patch4_32", num_classes=10)
    with pytest.raises(ValueError, match="unexpected|missing|mismatched"):
        load_pretrained(wide, path)


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    m = vitflow.create_model("vit_cifar_patch4_32", num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    m(x).sum().backward()
    plain = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.set_grad_checkpointing(True)
    m(x).sum().backward()
    for a, p in zip(plain, m.parameters()):
        torch.testing.assert_close(p.grad, a, atol=1e-6, rtol=1e-5)


def test_jax_weight_init_matches_the_scheme():
    """weight_init="jax": zero head, Xavier-uniform linears, tiny MLP biases, LeCun patch embedding."""
    torch.manual_seed(0)
    m = vitflow.create_model("vit_small_patch16_224", num_classes=7, weight_init="jax")
    assert m.head.weight.abs().max() == 0 and m.head.bias.abs().max() == 0
    qkv = m.blocks[0].attn.qkv.weight  # (1152, 384): Xavier-uniform std = sqrt(2 / (fan_in + fan_out))
    assert qkv.std().item() == pytest.approx((2 / (384 + 1152)) ** 0.5, rel=0.02)
    assert 0 < m.blocks[0].mlp.fc1.bias.abs().max() < 1e-5 and m.blocks[0].attn.qkv.bias.abs().max() == 0
    pe = m.patch_embed.proj.weight  # fan_in 3 * 16 * 16
    assert pe.std().item() == pytest.approx((1 / 768) ** 0.5, rel=0.03)
    timm_init = vitflow.create_model("vit_small_patch16_224", num_classes=7)
    assert timm_init.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.03)  # timm: std 0.02
    with pytest.raises(ValueError, match="weight_init"):
        vitflow.create_model("vit_cifar_patch4_32", weight_init="xavier")
