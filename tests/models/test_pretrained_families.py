"""DeiT III, DINOv2 (+registers), CLIP and SigLIP towers in vitflow's ViT against timm's models of
the same names: every registered name builds timm's module tree (shapes, epsilons, activations);
one full-depth model per family loads a perturbed random timm state_dict with strict=True and
gives the same logits and pooled features (fp32, 1e-5) at its native size and at another one;
registers and the MAP head through gradient checkpointing, attention maps and ONNX export."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vitflow
from vitflow.models.vit.pretrained import PRETRAINED_FAMILIES

pytestmark = pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm / HF at fp32 rounding

timm = pytest.importorskip("timm")

NAMES = sorted(n for f in PRETRAINED_FAMILIES for n in f.variants)
TOL = dict(atol=1e-5, rtol=1e-5)


def perturbed_timm(name: str, seed: int = 0, **kw) -> nn.Module:
    """timm's model ``name`` with random weights where nothing is trivially 0 or 1 (every tensor
    set here, so timm's own init is skipped): weights normal (std 0.02), LayerScale gammas around
    0.5, norm weights around 1, biases / tokens / latent normal (std 0.1)."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, weight_init="skip", **kw).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("gamma"):
                p.copy_(0.5 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1 and "norm" in pname and pname.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1 or pname.endswith(("cls_token", "reg_token", "latent")):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.02 * torch.randn_like(p))
    return model


def ours_from(ref: nn.Module, name: str, **kw) -> nn.Module:
    model = vitflow.create_model(name, **kw).eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    return model


def assert_same_outputs(ref: nn.Module, ours: nn.Module, x: torch.Tensor) -> None:
    """Tokens, pooled features (``forward_head(tokens, pre_logits=True)``) and logits agree to 1e-5."""
    with torch.no_grad():
        t_tok, o_tok = ref.forward_features(x), ours.forward_features(x)
        torch.testing.assert_close(o_tok, t_tok, **TOL)
        t_pool, o_pool = ref.forward_head(t_tok, pre_logits=True), ours.forward_head(o_tok, pre_logits=True)
        torch.testing.assert_close(o_pool, t_pool, **TOL)
        t_logits, o_logits = ref.forward_head(t_tok), ours.forward_head(o_tok)
        torch.testing.assert_close(o_logits, t_logits, **TOL)
    assert t_pool.std() > 1e-2 and t_logits.std() > 1e-3  # not a degenerate comparison


# name, num_classes, other input size (timm with dynamic_img_size=True, vitflow fed that size)
PARITY = [
    ("deit3_small_patch16_224", 1000, 160),
    ("vit_small_patch14_dinov2", 10, 224),
    ("vit_small_patch14_reg4_dinov2", 10, 224),
    ("vit_base_patch32_clip_224", 1000, 288),
    ("vit_base_patch32_clip_quickgelu_224", 512, 160),
    ("vit_base_patch16_siglip_224", 10, 160),
    ("vit_base_patch16_siglip_gap_224", 10, 160),
]


@pytest.mark.parametrize("name,num_classes,other", PARITY)
def test_timm_weights_same_logits_native_and_other_size(name, num_classes, other):
    """Full depth, timm's name: strict load, same tokens / pooled / logits at the native size and,
    through the run-time position-embedding resampling, at ``other``."""
    ref = perturbed_timm(name, num_classes=num_classes, dynamic_img_size=True)
    ours = ours_from(ref, name, num_classes=num_classes)
    assert ours.num_classes == num_classes and ours.num_prefix_tokens == ref.num_prefix_tokens
    size = ours.img_size
    assert (size, size) == tuple(ref.patch_embed.img_size)
    torch.manual_seed(1)
    assert_same_outputs(ref, ours, torch.randn(1, 3, size, size))
    assert_same_outputs(ref, ours, torch.randn(2, 3, other, other))


@pytest.mark.parametrize("name,size", [("vit_small_patch14_reg4_dinov2", 98), ("deit3_small_patch16_384", 64),
                                       ("vit_base_patch16_siglip_384", 64), ("vit_base_patch16_clip_384", 64),
                                       ("vit_so400m_patch14_siglip_384", 62)])
def test_built_at_another_img_size_loads_timm_of_that_size(name, size):
    """``create_model(name, img_size=...)`` has timm's position-embedding shape at that size (no
    class / register entries where timm has none; so400m/14 at a size that is no multiple of 14 drops
    the last pixels as timm does); depth reduced to 2."""
    ref = perturbed_timm(name, img_size=size, depth=2, num_classes=5)
    ours = ours_from(ref, name, img_size=size, depth=2, num_classes=5)
    assert_same_outputs(ref, ours, torch.randn(2, 3, size, size))


def test_dinov2_giant_swiglu_block_matches_timm():
    """vit_giant_patch14_dinov2's packed SwiGLU MLP (timm SwiGLUPacked), one block at 56 px."""
    ref = perturbed_timm("vit_giant_patch14_dinov2", img_size=56, depth=1, num_classes=3)
    ours = ours_from(ref, "vit_giant_patch14_dinov2", img_size=56, depth=1, num_classes=3)
    assert ours.blocks[0].mlp.fc2.in_features == 4096
    assert_same_outputs(ref, ours, torch.randn(2, 3, 56, 56))


def _structure(model: nn.Module) -> dict:
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    eps = sorted({m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)})
    act = model.blocks[0].mlp.act.to("cpu")  # stateless: compared by its values
    values = act(torch.linspace(-3, 3, 13)).tolist()
    return dict(shapes=shapes, eps=eps, act=values, prefix=model.num_prefix_tokens, classes=model.num_classes,
                no_embed_class=model.no_embed_class, pool=model.global_pool)


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_name_is_timms_architecture(name):
    """Built on the meta device: the same state_dict names and shapes as timm's model of the name
    (timm's default class count), the same LayerNorm epsilon, MLP activation (by its values),
    prefix tokens, position-embedding rule and pooling."""
    assert name in timm.list_models(name)
    with torch.device("meta"):
        ref, ours = timm.create_model(name), vitflow.create_model(name)
    assert _structure(ours) == _structure(ref)


def test_models_command_lists_the_families(capsys):
    from vitflow.cli import main

    assert main(["models", "*reg4*"]) == 0
    out = capsys.readouterr().out
    assert "dinov2:" in out and "vit_small_patch14_reg4_dinov2" in out and "cls+4 reg (pos on patches)" in out
    assert main(["models", "vit_base_patch16_siglip_*"]) == 0
    out = capsys.readouterr().out
    assert "siglip:" in out and "pool map" in out and "pool avg no fc_norm" in out


def test_refused_combinations_name_the_argument():
    with pytest.raises(ValueError, match="pos_embed='relative'.*reg_tokens"):
        vitflow.create_model("vit_small_patch14_reg4_dinov2", pos_embed="relative", depth=1)
    with pytest.raises(ValueError, match="global_pool='token' needs the class token"):
        vitflow.create_model("vit_base_patch16_siglip_224", global_pool="token", depth=1)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) for deit3 models: distilled=True"):
        vitflow.create_model("deit3_small_patch16_224", distilled=True, depth=1)
    with pytest.raises(ValueError, match="act_layer must be one of"):
        vitflow.create_model("vit_base_patch32_clip_224", act_layer="relu", depth=1)


def small_pair(name: str, size: int, depth: int = 2, num_classes: int = 5) -> tuple[nn.Module, nn.Module]:
    ref = perturbed_timm(name, img_size=size, depth=depth, num_classes=num_classes)
    return ref, ours_from(ref, name, img_size=size, depth=depth, num_classes=num_classes)


@pytest.mark.parametrize("name,size", [("vit_small_patch14_reg4_dinov2", 56), ("vit_base_patch16_siglip_224", 64)])
def test_grad_checkpointing_recomputes_and_keeps_gradients(name, size):
    """Registers / MAP head with every block checkpointed: the block's attention runs twice
    (forward and recomputation), the loss and the gradients equal the plain run's."""
    _, model = small_pair(name, size)
    model.train()
    x = torch.randn(2, 3, size, size)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))

    def run() -> tuple[torch.Tensor, dict]:
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = run()
    assert len(calls) == 1
    model.set_grad_checkpointing(True)
    loss_ckpt, grads_ckpt = run()
    assert len(calls) == 3  # forward + recomputation in the backward
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=1e-6)
    for n in ("reg_token", "cls_token", "attn_pool.latent", "blocks.0.attn.qkv.weight", "patch_embed.proj.weight"):
        if n in grads:
            assert grads[n].abs().sum() > 0
            torch.testing.assert_close(grads_ckpt[n], grads[n], atol=1e-6, rtol=1e-5)


def test_attention_maps_with_registers_match_timm_probabilities():
    """attention_maps of vit_small_patch14_reg4_dinov2 = timm's softmax probabilities: rows and
    columns ordered [cls, 4 registers, patches]; the registers take part of every row's mass."""
    ref, ours = small_pair("vit_small_patch14_reg4_dinov2", 56)
    captured = []
    for blk in ref.blocks:
        blk.attn.fused_attn = False
        blk.attn.attn_drop.register_forward_hook(lambda m, i, out: captured.append(out))
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ref(x)
        maps = ours.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 6, 1 + 4 + 16, 1 + 4 + 16)
    for got, want in zip(maps, captured):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    register_mass = maps[-1][..., 1:5].sum(-1)
    assert torch.allclose(maps[-1].sum(-1), torch.ones(()), atol=1e-5) and register_mass.min() > 0.01


def test_map_head_probabilities_rebuild_the_pooled_feature():
    """AttentionPoolLatent.probs is the weighting the MAP head pools with: the probabilities times
    the values, through proj and the residual MLP, give forward_head's pooled feature."""
    _, ours = small_pair("vit_base_patch16_siglip_224", 64)
    pool = ours.attn_pool
    with torch.no_grad():
        tokens = ours.forward_features(torch.randn(2, 3, 64, 64))
        probs = pool.probs(tokens)
        b, n, d = tokens.shape
        v = pool.kv(tokens)[..., d:].reshape(b, n, pool.num_heads, pool.head_dim)
        y = pool.proj(torch.einsum("bhn,bnhd->bhd", probs, v).reshape(b, 1, d))
        y = (y + pool.mlp(pool.norm(y)))[:, 0]
        torch.testing.assert_close(y, ours.forward_head(tokens, pre_logits=True), atol=1e-5, rtol=1e-5)
    assert probs.shape == (2, 12, 16) and torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("name,size", [("vit_small_patch14_reg4_dinov2", 56), ("vit_base_patch16_siglip_224", 64)])
def test_onnx_export_with_registers_and_map_head(name, size, tmp_path):
    """ONE ONNX export with a dynamic batch (ONNX Runtime) and one TorchScript trace agree with
    PyTorch at batch 1 and 3."""
    pytest.importorskip("onnxruntime")
    from vitflow.data.transforms import Preprocess
    from vitflow.infer.export.formats import export_onnx, export_torchscript, load_exported, verify
    from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel

    _, model = small_pair(name, size)
    pp = Preprocess(size, 1.0)
    info = ModelInfo([f"c{i}" for i in range(5)], pp, {"name": name, "num_classes": 5, "img_size": size, "depth": 2})
    x = torch.randn(3, 3, size, size)
    path = export_onnx(model, tmp_path / "m.onnx", info)
    check = verify(model, OnnxModel(path), x, batch_sizes=(1, 3), tolerance=1e-4)
    assert check.ok and check.worst <= 1e-4, check.summary()
    export_torchscript(model, tmp_path / "m.ts", info)  # traced: the batch size stays free
    check = verify(model, load_exported(tmp_path / "m.ts", "torchscript")[0], x, batch_sizes=(1, 3), tolerance=1e-4)
    assert check.ok, check.summary()


def test_pretrained_file_at_518_loads_into_a_224_model(tmp_path):
    """A DINOv2-reg file of timm's native 518 px, loaded with create_model(img_size=224,
    pretrained=...): the patch-only position embedding is resampled (no prefix rows) and the
    model equals timm's at 224 (run-time resampling of the same table)."""
    from vitflow.models.pretrained.weights import save_safetensors

    ref = perturbed_timm("vit_small_patch14_reg4_dinov2", depth=1, num_classes=4, dynamic_img_size=True)
    save_safetensors(ref, tmp_path / "reg4.safetensors")
    ours = vitflow.create_model("vit_small_patch14_reg4_dinov2", img_size=224, depth=1, num_classes=4,
                                pretrained=tmp_path / "reg4.safetensors").eval()
    assert ours.pos_embed.shape == (1, 16 * 16, 384)
    assert_same_outputs(ref, ours, torch.randn(2, 3, 224, 224))


def test_optimizer_groups_know_the_new_tokens():
    """reg_token and CLIP's norm_pre sit with the embeddings (layer 0) for layer-wise lr decay,
    the MAP head with the head; reg_token gets no weight decay."""
    from vitflow.training.optim.optimizers import layer_id

    model = vitflow.create_model("vit_small_patch14_reg4_dinov2", img_size=56, depth=2)
    assert "reg_token" in model.no_weight_decay()
    assert layer_id("reg_token", 2) == layer_id("norm_pre.weight", 2) == 0
    assert layer_id("attn_pool.latent", 2) == layer_id("attn_pool.mlp.fc1.weight", 2) == 3


def test_sparse_backend_and_patch_dropout_count_the_registers():
    """With registers the prefix is 5 tokens: a local window covering the whole 4x4 grid equals
    dense attention (registers attend and are attended to like the class token), and
    PatchDropout keeps all 5 prefix tokens while dropping patches."""
    ref, dense = small_pair("vit_small_patch14_reg4_dinov2", 56)
    local = ours_from(ref, "vit_small_patch14_reg4_dinov2", img_size=56, depth=2, num_classes=5,
                      attention="local", attn_window=3)
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(local(x), dense(x), atol=1e-5, rtol=1e-5)
    dropping = ours_from(ref, "vit_small_patch14_reg4_dinov2", img_size=56, depth=2, num_classes=5,
                         patch_drop_rate=0.5).train()
    tokens = dropping.forward_features(x)
    assert tokens.shape == (2, 5 + 8, 384)
    x_tok, _ = dropping._embed(x)  # the prefix tokens survive unchanged through the embedding
    torch.testing.assert_close(dropping.patch_drop(x_tok, 5)[:, :5], x_tok[:, :5])


@pytest.mark.parametrize("name,size", [("vit_small_patch14_reg4_dinov2", 56), ("vit_base_patch16_siglip_224", 64)])
def test_dynamic_int8_quantizes_blocks_and_map_head(name, size):
    """quantize_torch (dynamic INT8 of every linear) runs on registers / LayerScale and on the MAP
    head (its q, kv, proj, MLP quantised too); logits stay within 10% of their range."""
    from vitflow.infer.quantize.dynamic import quantize_torch

    _, model = small_pair(name, size)
    q = quantize_torch(model)
    quantised = {n for n, m in q.named_modules() if "quantized" in type(m).__module__}
    assert "blocks.0.attn.qkv" in quantised and "head" in quantised
    if model.attn_pool is not None:
        assert {"attn_pool.q", "attn_pool.kv", "attn_pool.proj", "attn_pool.mlp.fc2"} <= quantised
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        ref, got = model(x), q(x)
    assert (got - ref).abs().max() <= 0.1 * (ref.max() - ref.min())
