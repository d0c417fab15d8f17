"""MViTv2: timm parity (strict state_dict load, same logits, at two input sizes), torchvision's
mvit_v2_s converted, the pooling-attention backends and checkpointing agree in value and gradient,
the C++ pooling kernel against PyTorch's convolution, config keys, other input sizes, weights of
another size, attention maps."""

from unittest import mock

import pytest
import torch

from helpers import check_checkpoint_plans, output_and_grads
from vitflow.models import create_model, list_models, model_args
from vitflow.models.kernels import cpp
from vitflow.models.kernels.pool import pool_qkv
from vitflow.models.mvit.model import MultiScaleVit, grid_transfer
from vitflow.models.mvit.pooling import pool_tokens

timm = pytest.importorskip("timm")


def _randomise(model, scale=0.2):
    """Non-trivial values in every 1-D parameter (biases, norms): random init leaves them 0 / 1."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * scale)
    return model


@pytest.mark.parametrize("name,size", [("mvitv2_tiny", 224), ("mvitv2_small_cls", 224), ("mvitv2_tiny", 256)])
@pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm at fp32 rounding
def test_timm_parity_strict_load_same_logits(name, size):
    """timm's model of the same name (random weights, at 224 and at 256 px: timm's tables then sized
    for 256) loads with strict=True; logits and pooled features within 1e-5 in float32."""
    torch.manual_seed(0)
    ref = _randomise(timm.create_model(name, pretrained=False, img_size=size)).eval()
    ours = create_model(name, img_size=size).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        feats = ours.forward_features(x)
        torch.testing.assert_close(ours.forward_head(feats, pre_logits=True),
                                   ref.forward_head(ref.forward_features(x), pre_logits=True), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert feats.shape == (1, ours.num_prefix_tokens + (size // 32) ** 2, 768) and want.std() > 0.1


@pytest.mark.parametrize("name", ["mvitv2_large", "mvitv2_huge_cls"])
@pytest.mark.usefixtures("torch_fp32_gemm")
def test_timm_configurations_at_reduced_depth(name):
    """The other configurations at depths 1-2-1-1 and 96 px: mvitv2_large widens in the MLP
    (timm's expand_attn=False: a stage's last block widens to the next stage's width, through
    shortcut_proj_mlp), mvitv2_huge_cls has 3 heads of 64 and a class token."""
    import dataclasses

    from timm.models.mvitv2 import MultiScaleVit as TimmMViT
    from timm.models.mvitv2 import model_cfgs

    torch.manual_seed(4)
    ref = _randomise(TimmMViT(dataclasses.replace(model_cfgs[name], depths=(1, 2, 1, 1)), img_size=96)).eval()
    ours = create_model(name, depths=(1, 2, 1, 1), img_size=96).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


@pytest.mark.usefixtures("torch_fp32_gemm")
def test_other_input_size_resamples_tables_like_timm_loading(caplog):
    """A 224-px model run on 256 px resamples its relative tables at run time (logged); timm's
    256-px model given the same weights through its own checkpoint filter (the same linear
    resampling) computes the same logits."""
    from timm.models.mvitv2 import MultiScaleVit as TimmMViT
    from timm.models.mvitv2 import MultiScaleVitCfg, checkpoint_filter_fn

    torch.manual_seed(1)
    ours = _randomise(create_model("mvitv2_tiny", depths=(1, 1, 1, 1))).eval()
    ref = TimmMViT(MultiScaleVitCfg(depths=(1, 1, 1, 1)), img_size=256).eval()
    ref.load_state_dict(checkpoint_filter_fn(dict(ours.state_dict()), ref), strict=True)
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad(), caplog.at_level("INFO"):
        got = ours(x)
    torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=0)
    assert "rel_pos_h 111 -> 127 rows, rel_pos_w 111 -> 127 rows" in caplog.text


@pytest.mark.usefixtures("torch_fp32_gemm")
def test_torchvision_mvit_v2_s_converted_gives_torchvision_logits(tmp_path):
    """torchvision's mvit_v2_s (random weights; built for one-frame clips: its image input) through
    the converter: vitflow's mvit_v2_s loads it strictly (from the file, layout detected) and gives
    torchvision's logits; the published 16-frame layout (temporal tables of 15 rows) converts to the
    same weights when those tables' centre rows are the one-frame rows."""
    import torchvision.models.video.mvit as tvm

    build = tvm._mvit

    def one_frame(*args, **kwargs):
        return build(*args, **{**kwargs, "temporal_size": 2})  # stride 2 in time: one frame's tokens

    torch.manual_seed(2)
    with mock.patch.object(tvm, "_mvit", one_frame):
        tv = _randomise(tvm.mvit_v2_s()).eval()
    torch.save(tv.state_dict(), tmp_path / "tv.pth")
    ours = create_model("mvit_v2_s", num_classes=400, pretrained=tmp_path / "tv.pth").eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want = tv(x)
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=0)
    assert want.std() > 0.1
    from vitflow.models.convert.torchvision_mvit import torchvision_mvit_to_timm

    video = {k: torch.cat((torch.randn(7, v.shape[1]), v, torch.randn(7, v.shape[1]))) if k.endswith("rel_pos_t")
             else v for k, v in tv.state_dict().items()}
    converted, direct = torchvision_mvit_to_timm(video), ours.state_dict()
    assert video["blocks.0.attn.rel_pos_t"].shape == (15, 96)
    assert all(torch.allclose(v, direct[k], atol=1e-6) for k, v in converted.items())


def _small(cls=False, residual="all"):
    torch.manual_seed(0)
    model = MultiScaleVit(img_size=32, patch_size=2, depths=(1, 2, 2), embed_dim=16, num_heads=(1, 2, 2),
                          num_classes=5, class_token=cls, residual_pooling=residual, stride_kv_adaptive=2)
    return _randomise(model)


@pytest.mark.parametrize("cls,residual", [(False, "all"), (True, "grid")])
def test_backends_agree_in_value_and_gradients(cls, residual):
    """sdpa, math and auto: forward, input and parameter gradients (relative tables, pooling
    kernels and norms included) within 1e-5; in bf16 autocast (math's relative terms inside the
    widened GEMM) within bf16 rounding of float32."""
    model = _small(cls, residual)
    x = torch.randn(2, 3, 32, 32)
    results = {}
    for backend in ("sdpa", "math", "auto"):
        model.set_attention_backend(backend)
        results[backend] = output_and_grads(model, x)
    assert model.attention_backend == "auto"
    for backend in ("math", "auto"):
        out, gx, grads = results[backend]
        torch.testing.assert_close(out, results["sdpa"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(gx, results["sdpa"][1], atol=1e-5, rtol=1e-4)
        for n, g in grads.items():
            torch.testing.assert_close(g, results["sdpa"][2][n], atol=1e-5, rtol=1e-4, msg=n)
    model.set_attention_backend("math")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, gx, grads = output_and_grads(model, x)
    torch.testing.assert_close(out.float(), results["sdpa"][0], atol=0.1, rtol=0.05)
    # relative norms of the gradients' bf16 error: the relative tables' gradients are sums with much
    # cancellation (timm's own bf16 autocast: 8-16% on this model, measured; vitflow's 12-22%)
    for n, tol in (("stages.0.blocks.0.attn.rel_pos_h", 0.3), ("stages.1.blocks.1.attn.rel_pos_w", 0.3),
                   ("stages.1.blocks.1.attn.qkv.weight", 0.03), ("stages.0.blocks.0.attn.pool_q.weight", 0.05)):
        ref = results["sdpa"][2][n]
        assert grads[n].dtype == torch.float32 and (grads[n] - ref).norm() <= tol * ref.norm(), n


def test_checkpointed_gradients_identical_and_plans():
    assert check_checkpoint_plans(_small(), torch.randn(2, 3, 32, 32), "1,3") == [False, True, False, True, False]


@pytest.mark.skipif(not cpp.available(), reason="no C++ toolchain")
@pytest.mark.parametrize("prefix,grid,heads,d,strides,dtype", [
    (0, (8, 8), 2, 16, (1, 4), torch.float32),   # d a multiple of the vector width: the register path
    (1, (7, 9), 3, 20, (2, 2), torch.float32),   # class token, odd grid, d not a multiple of 8
    (1, (6, 6), 1, 32, (1, 1), torch.bfloat16),
    (1, (7, 9), 2, 24, (2, 2), torch.float32),   # class token, odd grid, 8-lane vectors across heads
    (0, (16, 16), 4, 64, (2, 1), torch.float32),  # whole 4-vector groups, pooled queries
    (1, (9, 7), 2, 48, (2, 2), torch.bfloat16),
])
def test_pool_kernel_matches_pytorch_convolution(prefix, grid, heads, d, strides, dtype):
    """vitflow's C++ pooling of q, k, v against PyTorch's depthwise convolution in float64: outputs,
    the qkv gradient and the three kernels' gradients (float32 to 1e-5 relative, bf16 to its rounding)."""
    torch.manual_seed(3)
    c = heads * d
    convs = [torch.nn.Conv2d(d, d, 3, s, 1, groups=d, bias=False) for s in (strides[0], strides[1], strides[1])]
    qkv = torch.randn(2, prefix + grid[0] * grid[1], 3 * c)
    x64 = qkv.double().requires_grad_()
    ref = [pool_tokens(x64[..., i * c:(i + 1) * c], grid, heads, conv.double(), prefix)[0]
           for i, conv in enumerate(convs)]
    gs = [torch.randn_like(r) for r in ref]
    sum((r * g).sum() for r, g in zip(ref, gs)).backward()
    want_w = [conv.weight.grad.clone() for conv in convs]
    for conv in convs:
        conv.float().weight.grad = None
    xi = qkv.to(dtype).requires_grad_()
    got = pool_qkv(xi, tuple(convs), grid, prefix, heads)
    sum((o.double() * g).sum() for o, g in zip(got, gs)).backward()
    tol = dict(atol=0.05, rtol=0.02) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for o, r in zip(got, ref):
        assert o.dtype == dtype and o.is_contiguous()
        torch.testing.assert_close(o.double(), r.detach(), **tol)
    torch.testing.assert_close(xi.grad.double(), x64.grad, **tol)
    for conv, w in zip(convs, want_w):
        torch.testing.assert_close(conv.weight.grad.double(), w, atol=tol["atol"] * 20, rtol=tol["rtol"])


def test_registry_config_keys_layer_decay_and_other_sizes(caplog):
    for name in ("mvitv2_tiny", "mvitv2_small", "mvitv2_base", "mvitv2_large", "mvitv2_small_cls",
                 "mvitv2_base_cls", "mvitv2_large_cls", "mvitv2_huge_cls", "mvit_v2_s", "mvitv2_cifar_32"):
        assert name in list_models("mvit*")
    model = create_model("mvitv2_cifar_32", num_classes=10, drop_path_rate=0.1, attention="math", embed_dim=16,
                         grad_checkpointing="every:2")
    assert model.supports_pruning is False and model.attention_backend == "math"
    assert [b.attn.dim_out for b in model.blocks] == [16, 32, 32, 64, 64, 64, 64, 64]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with caplog.at_level("INFO"):
        assert model(torch.randn(1, 3, 24, 40)).shape == (1, 10)  # other sizes: tables resampled, logged
    assert ("tables resampled for a 12x20 query / 6x10 key grid: rel_pos_h 31 -> 23 rows, rel_pos_w 31 -> 39 rows"
            in caplog.text)
    model.reset_classifier(3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3) and model.head.fc.out_features == 3
    assert {"stages.0.blocks.0.attn.rel_pos_h", "stages.2.blocks.4.attn.rel_pos_w"} <= model.no_weight_decay()
    from vitflow.training.optim.optimizers import param_groups

    ids = {n: model.layer_id(n) for n, _ in model.named_parameters()}  # layer-wise lr decay over all stages
    assert ids["patch_embed.proj.weight"] == 0 and ids["stages.1.blocks.1.attn.qkv.weight"] == 3
    assert ids["stages.2.blocks.0.attn.pool_q.weight"] == 4 and ids["head.fc.weight"] == 9 == ids["norm.weight"]
    assert len({g["lr_scale"] for g in param_groups(model, 0.05, 1.0, layer_decay=0.5)}) == 10
    for key, value in (("depth", 4), ("layer_scale_init", 1e-5), ("patch_drop_rate", 0.1), ("distilled", True),
                       ("weight_init", "jax"), ("pos_embed", "sincos2d"), ("attention", "linformer"),
                       ("global_pool", "token"), ("global_pool", "map")):
        with pytest.raises(ValueError, match=f"{key}|{value}"):
            create_model("mvitv2_cifar_32", **{key: value})
    with pytest.raises(ValueError, match="unknown argument"):
        create_model("mvitv2_cifar_32", colour="red")


def test_model_section_is_mvit_config():
    """MViTConfig: the family's keys from the command line (per-stage depths), a ViT preset's
    ViT-only keys left out, a ViT key given by the user refused in one line naming the family's
    keys, a class-token pool refused on a variant without a class token."""
    from vitflow.config import ConfigError, MViTConfig, build_config
    from vitflow.models import check_config, config_class

    cfg = build_config("cifar10-vit-tiny", overrides=["model.name=mvitv2_cifar_32", "model.depths=1,1,2",
                                                      "model.num_heads=2", "model.attention=math"],
                       model_config=config_class, checks={"model": check_config})
    assert type(cfg.model) is MViTConfig and cfg.model.depths == (1, 1, 2) and not hasattr(cfg.model, "pos_embed")
    model = create_model(**model_args(cfg.model, 10))
    assert model.depths == (1, 1, 2) and [b.attn.num_heads for b in model.blocks] == [2, 4, 8, 8]
    with pytest.raises(ConfigError, match=r"model.patch_drop_rate is not a key of MViTv2 models .*depths, num_heads"):
        build_config(overrides=["model.name=mvitv2_cifar_32", "model.patch_drop_rate=0.5"], model_config=config_class)
    with pytest.raises(ConfigError, match="model.attention"):
        build_config(overrides=["model.name=mvitv2_cifar_32", "model.attention=linformer"], model_config=config_class)
    with pytest.raises(ConfigError, match="model.global_pool='token' is invalid: mvitv2_tiny has no class token"):
        build_config(overrides=["model.name=mvitv2_tiny", "model.global_pool=token"], model_config=config_class,
                     checks={"model": check_config})


def test_pretrained_file_of_another_size_and_class_count(tmp_path, caplog):
    """A 224-px, 1000-class file into a 256-px, 5-class model: tables resampled (logged), head
    fresh; at the file's own size and classes the load is exact."""
    ref = _randomise(create_model("mvitv2_tiny", depths=(1, 1, 1, 1)))
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    exact = create_model("mvitv2_tiny", depths=(1, 1, 1, 1), pretrained=tmp_path / "w.pth")
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in exact.state_dict().items())
    with caplog.at_level("INFO"):
        model = create_model("mvitv2_tiny", depths=(1, 1, 1, 1), pretrained=tmp_path / "w.pth", img_size=256,
                             num_classes=5)
    assert "head reset: 1000 -> 5" in caplog.text and "rel_pos_h/w: 111 -> 127 rows (resampled)" in caplog.text
    table = model.stages[0].blocks[0].attn.rel_pos_h
    assert table.shape == (127, 96) and model.head.fc.out_features == 5
    torch.testing.assert_close(table[0], ref.stages[0].blocks[0].attn.rel_pos_h[0], atol=0.05, rtol=0)


def test_attention_maps_on_each_blocks_grid():
    """Maps per block on its output grid (keys spread over the cells their region covers): rows sum
    to 1; the blocks of a stage share a grid; ``grid_transfer`` conserves mass both ways."""
    model = _small(cls=True).eval()
    x = torch.randn(1, 3, 32, 32)
    maps = model.attention_maps(x, [0, 1, -1])
    assert [m.shape for m in maps] == [(1, 1, 257, 257), (1, 2, 65, 65), (1, 2, 17, 17)]
    assert model.attention_grid(-1) == (4, 4) and model.key_grid(0) == (8, 8)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    for src, dst in (((8, 8), (16, 16)), ((8, 8), (4, 4)), ((3, 5), (7, 2))):
        t = grid_transfer(src, dst)
        torch.testing.assert_close(t.sum(1), torch.ones(src[0] * src[1]))
