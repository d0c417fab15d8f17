"""Swin / Swin V2: timm parity (strict state_dict load, same logits, at two input sizes), the
window backends and checkpointing agree in value and gradient, config keys, attention maps."""

import pytest
import torch

from helpers import check_checkpoint_plans, output_and_grads
from vitflow.models import create_model, list_models
from vitflow.models.attention.window import shift_mask
from vitflow.models.kernels.matmul import set_gemm_mode
from vitflow.models.swin.model import SwinTransformer

timm = pytest.importorskip("timm")

SMALL = dict(depths=(2, 2, 2, 1), embed_dim=32, num_heads=(1, 2, 4, 8))  # shifted blocks in 3 stages; fast


def _timm(name, **kw):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kw).eval()
    with torch.no_grad():  # random, non-trivial values everywhere (biases, norms, V2's scale and cpb)
        for n, p in model.named_parameters():
            if "logit_scale" in n:
                p.copy_(torch.rand_like(p) * 3 + 0.5)  # some above the clamp at ln 100
            elif p.ndim == 1 or "cpb_mlp" in n or "relative_position_bias_table" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("name,kw", [
    ("swin_tiny_patch4_window7_224", {}),
    ("swin_tiny_patch4_window7_224", dict(img_size=256, window_size=8)),  # a second size timm supports
    ("swinv2_tiny_window8_256", {}),
    ("swinv2_tiny_window8_256", dict(img_size=192, window_size=12)),
])
@pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm at fp32 rounding
def test_timm_parity_strict_load_same_logits(name, kw):
    ref = _timm(name, **SMALL, **kw)
    ours = create_model(name, **SMALL, **kw).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    size = kw.get("img_size", ref.default_cfg["input_size"][-1] if not kw else 224)
    x = torch.randn(1 if kw else 2, 3, size, size)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        feats = ours.forward_features(x)
    assert feats.shape == ref.forward_features(x).shape and feats.ndim == 4  # NHWC
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.forward_head(feats, pre_logits=True),
                               ref.forward_head(ref.forward_features(x), pre_logits=True), atol=1e-5, rtol=0)
    assert want.std() > 0.1
    if not kw:  # gradients too: the input's, through shifted windows (one gather each way)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xa).square().sum().backward()
        ours(xb).square().sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, atol=1e-5, rtol=1e-4)


def _block_model(version):
    torch.manual_seed(0)
    model = SwinTransformer(img_size=16, patch_size=2, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=4,
                            version=version, num_classes=5, drop_path_rate=0.0)
    if version == 2:
        with torch.no_grad():
            for blk in model.blocks:
                blk.attn.logit_scale.uniform_(0.5, 5.0)
    return model


@pytest.mark.parametrize("version", [1, 2])
def test_backends_agree_in_value_and_gradients(version):
    """sdpa, math, fused (vitflow's C++ kernel; V2 runs math there) and auto on shifted-window
    blocks (window 4 on an 8x8 grid: block 1 shifts): forward and input / parameter gradients,
    the position-bias table's included, within 1e-5."""
    model = _block_model(version)
    assert any(any(b.shift) for b in model.blocks)
    x = torch.randn(2, 3, 16, 16)
    results = {}
    for backend in ("sdpa", "math", "fused", "auto"):
        model.set_attention_backend(backend)
        results[backend] = output_and_grads(model, x)
    assert model.attention_backend == "auto"
    assert "fused" in model.blocks[0].attn.kernel.candidates  # the kernels build here (CI's machine too)
    for backend in ("math", "fused", "auto"):
        out, gx, grads = results[backend]
        torch.testing.assert_close(out, results["sdpa"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(gx, results["sdpa"][1], atol=1e-5, rtol=1e-4)
        for n, g in grads.items():
            torch.testing.assert_close(g, results["sdpa"][2][n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_bf16_autocast_training_with_either_gemm(version, gemm):
    """bf16-autocast training runs with both linear kernels (V2's position-bias MLP modifies a
    Linear's output in place: ReLU(inplace=True)): outputs near float32's, finite float32
    gradients, V1's within 5% (relative norm; measured ~1.4%) of float32's — V2's logit scales of
    up to 100 amplify bf16's rounding of q and k (~20-45% here), so only finiteness is checked there;
    the position bias the kernels add to every window's logits is contiguous (strided, that add
    ran ~6x slower)."""
    model = _block_model(version)
    x = torch.randn(2, 3, 16, 16)
    ref = output_and_grads(model, x)
    set_gemm_mode(model, gemm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, gx, grads = output_and_grads(model, x)
    torch.testing.assert_close(out.float(), ref[0], atol=0.1, rtol=0.05)
    assert out.dtype == torch.bfloat16 and torch.isfinite(gx).all()
    for n, g in grads.items():
        assert torch.isfinite(g).all() and g.dtype == torch.float32, n
        if version == 1 and ref[2][n].norm() > 0:
            assert (g - ref[2][n]).norm() <= 0.05 * ref[2][n].norm(), n
    assert all(blk.attn.position_bias().is_contiguous() for blk in model.blocks)


def test_checkpointed_gradients_identical_and_plans():
    assert check_checkpoint_plans(_block_model(1), torch.randn(2, 3, 16, 16), "1,3") == [False, True, False, True]


def test_shift_mask_separates_rolled_regions():
    mask = shift_mask((8, 8), (4, 4), (2, 2))
    assert mask.shape == (4, 1, 16, 16)
    assert (mask[0] == 0).all()  # the top-left window holds one region
    last = mask[3, 0]  # the bottom-right window mixes four regions: each token sees 4 of 16
    assert ((last == 0).sum(1) == 4).all() and set(last.unique().tolist()) == {0.0, -100.0}


def test_attention_maps_on_the_grid_and_bias_cache():
    model = _block_model(1).eval()
    x = torch.randn(1, 3, 16, 16)
    maps = model.attention_maps(x, [0, 1, -1])
    assert [m.shape for m in maps] == [(1, 2, 64, 64), (1, 2, 64, 64), (1, 4, 16, 16)]
    assert model.attention_grid(-1) == (4, 4)
    for m in maps:  # each row a distribution over the query's window (16 tokens of a 4x4 window)
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
        assert ((m[0, 0] > 0).sum(-1) <= 16).all()
    # unshifted block 0: token (0, 0) attends within the top-left 4x4 window only
    row = maps[0][0, 0, 0].view(8, 8)
    assert row[:4, :4].gt(0).all() and row[4:].eq(0).all() and row[:, 4:].eq(0).all()
    blk = model.blocks[1]
    with torch.no_grad():
        first = blk.attn_bias(8, 8, x.device)
        assert first.shape == (4, 2, 16, 16) and blk.attn_bias(8, 8, x.device) is first  # cached
        blk.attn.relative_position_bias_table.add_(1.0)
        assert not torch.equal(blk.attn_bias(8, 8, x.device), first)


def test_registry_config_keys_and_other_sizes():
    names = list_models("swin*")
    for name in ("swin_tiny_patch4_window7_224", "swin_base_patch4_window12_384", "swin_large_patch4_window7_224",
                 "swinv2_tiny_window8_256", "swinv2_small_window8_256", "swinv2_tiny_window16_256",
                 "swinv2_base_window8_256", "swin_cifar_patch2_window4_32"):
        assert name in names
    model = create_model("swin_cifar_patch2_window4_32", num_classes=10, drop_path_rate=0.1, attention="math",
                         pos_embed="learned", attn_window=5, grad_checkpointing="every:2")
    assert model.supports_pruning is False and model.attention_backend == "math"
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert model(torch.randn(1, 3, 24, 40)).shape == (1, 10)  # other sizes: padded windows
    model.reset_classifier(3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3) and model.head.fc.out_features == 3
    assert any("relative_position_bias_table" in n for n in model.no_weight_decay())
    from vitflow.training.optim.optimizers import param_groups

    ids = {n: model.layer_id(n) for n, _ in model.named_parameters()}  # layer-wise lr decay over all stages
    assert ids["patch_embed.proj.weight"] == 0 and ids["layers.1.blocks.1.attn.qkv.weight"] == 4
    assert ids["layers.1.downsample.reduction.weight"] == 3 and ids["head.fc.weight"] == 7
    assert len({g["lr_scale"] for g in param_groups(model, 0.05, 1.0, layer_decay=0.5)}) == 8
    for key, value in (("depth", 4), ("num_heads", 2), ("layer_scale_init", 1e-5), ("patch_drop_rate", 0.1),
                       ("distilled", True), ("weight_init", "jax"), ("pos_embed", "sincos2d"),
                       ("attention", "linformer"), ("global_pool", "token")):
        with pytest.raises(ValueError, match=f"{key}|{value}"):
            create_model("swin_cifar_patch2_window4_32", **{key: value})
    with pytest.raises(ValueError, match="unknown argument"):
        create_model("swin_cifar_patch2_window4_32", colour="red")


def test_pretrained_file_of_another_window_and_class_count(tmp_path, caplog):
    """A timm file (window 7, 1000 classes) into a window-8, 5-class model: tables resampled,
    head fresh, logged; with the same window and classes the load is exact."""
    ref = _timm("swin_tiny_patch4_window7_224", **SMALL)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    exact = create_model("swin_tiny_patch4_window7_224", pretrained=tmp_path / "w.pth", **SMALL)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in exact.state_dict().items() if k in ref.state_dict())
    with caplog.at_level("INFO"):
        model = create_model("swin_tiny_patch4_window7_224", pretrained=tmp_path / "w.pth", img_size=256,
                             window_size=8, num_classes=5, **SMALL)
    assert "head reset: 1000 -> 5" in caplog.text and "window 7 -> 8" in caplog.text
    table = model.blocks[0].attn.relative_position_bias_table
    assert table.shape == (225, 1) and model.head.fc.out_features == 5
    torch.testing.assert_close(model.blocks[0].attn.relative_position_bias_table[112],  # the zero offset
                               ref.layers[0].blocks[0].attn.relative_position_bias_table[84], atol=0.05, rtol=0)
