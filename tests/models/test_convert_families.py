"""Foreign layouts -> timm names, one test per layout: a random-initialised transformers model
(small config) is converted and loaded with strict=True into the timm model of the matching
configuration, which must give the same features and pooled output (1e-5, fp32). Each test runs
twice (``side``): against timm's model, and against vitflow's own model of the same family
(``vitflow.create_model(<variant>, <the same small sizes>)``), since vitflow uses timm's names.

Where the libraries' defaults differ the timm side is configured to match, as stated per test
(LayerNorm eps: transformers' BEiT 1e-12, CLIP 1e-5, DINOv3 1e-5, timm's default 1e-6;
activations: CLIP quick_gelu, SigLIP tanh-GELU)."""

from functools import partial

import pytest
import torch

import vitflow
from vitflow.models.convert.openclip import convert_openclip
from vitflow.models.pretrained.weights import convert_layout, detect_layout

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from timm.models.beit import Beit  # noqa: E402
from timm.models.eva import Eva  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm / HF at fp32 rounding

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=28,
             patch_size=14)
VIT = dict(img_size=28, patch_size=14, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0)
VITFLOW = dict(img_size=28, patch_size=14, embed_dim=64, depth=2, num_heads=2)  # VIT's sizes for create_model
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["timm", "vitflow"])
def side(request):
    """Which implementation the converted state dict is loaded into."""
    return request.param


def target(side, timm_model, name, **sizes):
    """The model under test: ``timm_model()`` (timm's class, configured as the source), or
    vitflow's registered variant ``name`` with the same ``sizes`` (create_model overrides), in eval mode."""
    return (timm_model() if side == "timm" else vitflow.create_model(name, **sizes)).eval()


def randomised(model):
    """``model`` in eval mode with every tensor moved off its initial value (biases 0, norms 1,
    tokens ~0 would hide a mix-up)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def converted(sd, layout):
    assert detect_layout(dict(sd)) == layout
    return convert_layout(dict(sd), "test")


def image(size=28, batch=2):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def assert_same_outputs(ours, ref, layout: str, x: torch.Tensor | None = None) -> None:
    """``ref``'s state dict converted from ``layout`` loads strict into ``ours``; tokens equal
    ``last_hidden_state`` and ``ours(x)`` equals ``pooler_output`` (``TOL``)."""
    ours.load_state_dict(converted(ref.state_dict(), layout), strict=True)
    x = image() if x is None else x
    out = ref(pixel_values=x)
    assert torch.allclose(ours.forward_features(x), out.last_hidden_state, **TOL)
    assert torch.allclose(ours(x), out.pooler_output, **TOL)


def test_dinov2(side):
    ref = randomised(transformers.Dinov2Model(transformers.Dinov2Config(**{**SMALL, "intermediate_size": 256})))
    ours = target(side, lambda: VisionTransformer(**{**VIT, "mlp_ratio": 4.0}, init_values=1.0, num_classes=0),
                  "vit_small_patch14_dinov2", **VITFLOW, mlp_ratio=4.0)
    assert_same_outputs(ours, ref, "hf_dinov2")


def test_dinov2_with_registers(side):
    """The class token's position is folded into ``cls_token``; timm's ``no_embed_class``."""
    cfg = transformers.Dinov2WithRegistersConfig(**{**SMALL, "intermediate_size": 256}, num_register_tokens=4)
    ref = randomised(transformers.Dinov2WithRegistersModel(cfg))
    ours = target(side, lambda: VisionTransformer(**{**VIT, "mlp_ratio": 4.0}, init_values=1.0, reg_tokens=4,
                                                  no_embed_class=True, num_classes=0),
                  "vit_small_patch14_reg4_dinov2", **VITFLOW, mlp_ratio=4.0)
    assert_same_outputs(ours, ref, "hf_dinov2")


def test_dinov3(side):
    """timm's DINOv3 (``Eva`` with DINOv3 RoPE, q/v biases apart, LayerNorm eps 1e-5); vitflow's
    ``_qkvb`` variant, class-token pooling as transformers' ``pooler_output``."""
    cfg = transformers.DINOv3ViTConfig(**{**SMALL, "image_size": 32, "patch_size": 16}, num_register_tokens=4)
    ref = randomised(transformers.DINOv3ViTModel(cfg))
    ours = target(side, lambda: Eva(
        img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, qkv_bias=True, init_values=1.0,
        rope_type="dinov3", rope_temperature=100, rope_rotate_half=True, use_rot_pos_emb=True, use_abs_pos_emb=False,
        num_reg_tokens=4, use_fc_norm=False, global_pool="token", num_classes=0,
        norm_layer=partial(torch.nn.LayerNorm, eps=1e-5)),
        "vit_small_patch16_dinov3_qkvb", **{**VITFLOW, "img_size": 32, "patch_size": 16}, mlp_ratio=2.0,
        global_pool="token")
    assert_same_outputs(ours, ref, "hf_dinov3", image(32))


def clip_timm(num_classes=0):
    """timm's CLIP tower: pre-norm, no patch bias, LayerNorm eps 1e-5, quick_gelu (transformers' defaults)."""
    return VisionTransformer(**{**VIT, "mlp_ratio": 2.0}, pre_norm=True, act_layer="quick_gelu",
                             norm_layer=partial(torch.nn.LayerNorm, eps=1e-5), num_classes=num_classes).eval()


def clip_target(side, num_classes=0):
    """:func:`clip_timm`, or vitflow's OpenAI-style CLIP tower (``_quickgelu``) of the same sizes."""
    return target(side, lambda: clip_timm(num_classes), "vit_base_patch16_clip_quickgelu_224", **VITFLOW,
                  mlp_ratio=2.0, num_classes=num_classes)


def test_clip_vision_model(side):
    ref = randomised(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL)))
    ours = clip_target(side)
    ours.load_state_dict(converted(ref.state_dict(), "hf_clip"), strict=True)
    x = image()
    out = ref(pixel_values=x)
    assert torch.allclose(ours.forward_features(x), ref.post_layernorm(out.last_hidden_state), **TOL)
    assert torch.allclose(ours(x), out.pooler_output, **TOL)


def test_clip_model_full(side):
    """A full ``CLIPModel``: the vision tower plus ``visual_projection`` as the head (zero bias)."""
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=SMALL, projection_dim=24)
    ref = randomised(transformers.CLIPModel(cfg))
    ours = clip_target(side, num_classes=24)
    ours.load_state_dict(converted(ref.state_dict(), "hf_clip"), strict=True)
    x = image()
    expected = ref.get_image_features(pixel_values=x)
    expected = getattr(expected, "pooler_output", expected)
    assert torch.allclose(ours(x), expected, **TOL)


def siglip_target(side):
    """timm's SigLIP tower: no class token, MAP head, tanh-GELU (transformers' gelu_pytorch_tanh); or
    vitflow's SigLIP tower with tanh-GELU (``vit_base_patch32_siglip_256``) of the same sizes."""
    return target(side, lambda: VisionTransformer(**VIT, class_token=False, global_pool="map", act_layer="gelu_tanh",
                                                  num_classes=0),
                  "vit_base_patch32_siglip_256", **VITFLOW, mlp_ratio=2.0)


def test_siglip_vision_model(side):
    ref = randomised(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL)))
    ours = siglip_target(side)
    assert_same_outputs(ours, ref, "hf_siglip")


def test_siglip_model_full(side):
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99)
    ref = randomised(transformers.SiglipModel(transformers.SiglipConfig(text_config=text, vision_config=SMALL)))
    ours = siglip_target(side)
    ours.load_state_dict(converted(ref.state_dict(), "hf_siglip"), strict=True)
    x = image()
    expected = ref.get_image_features(pixel_values=x)
    expected = getattr(expected, "pooler_output", expected)
    assert torch.allclose(ours(x), expected, **TOL)


def test_beit_for_image_classification(side):
    """timm's ``Beit`` (vitflow's ``beit_base_patch16_224``) with transformers' LayerNorm eps 1e-12 and
    mean pooling (``fc_norm``)."""
    cfg = transformers.BeitConfig(**SMALL, use_relative_position_bias=True, use_mean_pooling=True, num_labels=5,
                                  layer_scale_init_value=0.1)
    ref = randomised(transformers.BeitForImageClassification(cfg))
    ours = target(side, lambda: Beit(**VIT, use_abs_pos_emb=False, use_rel_pos_bias=True, init_values=0.1,
                                     global_pool="avg", num_classes=5, norm_layer=partial(torch.nn.LayerNorm, eps=1e-12)),
                  "beit_base_patch16_224", **VITFLOW, mlp_ratio=2.0, num_classes=5, norm_eps=1e-12)
    ours.load_state_dict(converted(ref.state_dict(), "hf_beit"), strict=True)
    x = image()
    out = ref(pixel_values=x, output_hidden_states=True)
    assert torch.allclose(ours(x), out.logits, **TOL)
    assert torch.allclose(ours.forward_head(ours.forward_features(x), pre_logits=True),
                          ref.beit(pixel_values=x).pooler_output, **TOL)


def to_openclip(sd):
    """A timm CLIP state_dict in OpenCLIP's layout (the inverse of the module's table), under
    ``visual.`` with a text tower beside it, as in a full CLIP checkpoint."""
    out = {"visual.class_embedding": sd["cls_token"].reshape(-1), "visual.positional_embedding": sd["pos_embed"][0],
           "visual.conv1.weight": sd["patch_embed.proj.weight"], "visual.proj": sd["head.weight"].t().contiguous(),
           "token_embedding.weight": torch.randn(99, 32), "logit_scale": torch.tensor(4.6)}
    names = {"norm_pre": "ln_pre", "norm": "ln_post"}
    for k, v in sd.items():
        top = k.rsplit(".", 1)[0]
        if top in names:
            out[f"visual.{names[top]}.{k.rsplit('.', 1)[1]}"] = v
        elif k.startswith("blocks."):
            _, i, rest = k.split(".", 2)
            rest = (rest.replace("norm1", "ln_1").replace("norm2", "ln_2")
                    .replace("attn.qkv.weight", "attn.in_proj_weight").replace("attn.qkv.bias", "attn.in_proj_bias")
                    .replace("attn.proj", "attn.out_proj")
                    .replace("mlp.fc1", "mlp.c_fc").replace("mlp.fc2", "mlp.c_proj"))
            out[f"visual.transformer.resblocks.{i}.{rest}"] = v
            out[f"transformer.resblocks.{i}.{rest}"] = torch.randn(3)  # the text tower, to be dropped
    return out


def test_openclip_full_checkpoint(side):
    """OpenCLIP names -> timm: equal to timm's own converter (``checkpoint_filter_fn``), loads
    strict (timm's and vitflow's tower), same embedding as the source model; the text tower is dropped."""
    from timm.models.vision_transformer import checkpoint_filter_fn

    src = randomised(clip_timm(num_classes=24))
    torch.nn.init.zeros_(src.head.bias)  # OpenCLIP's projection has no bias
    sd = to_openclip(src.state_dict())
    ours = converted(sd, "openclip")
    timm_clip = clip_timm(num_classes=24)
    reference = checkpoint_filter_fn(dict(sd), timm_clip)
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    model = clip_target(side, num_classes=24)
    model.load_state_dict(ours, strict=True)
    x = image()
    assert torch.allclose(model(x), src(x), **TOL)
    assert convert_openclip({"module." + k: v for k, v in sd.items()}).keys() == ours.keys()


def to_v4_names(sd, prefix):
    """transformers 5.x block names -> the 4.x names of the checkpoints on the Hub
    (``encoder.layer.{i}.attention.attention.query``, ``attention.output.dense``,
    ``intermediate.dense`` / ``output.dense``), under ``prefix``."""
    rules = [(r"^(?:encoder\.)?layers?\.(\d+)\.attention\.([qkv])_proj\.",
              lambda m: f"encoder.layer.{m[1]}.attention.attention.{dict(q='query', k='key', v='value')[m[2]]}."),
             (r"^(?:encoder\.)?layers?\.(\d+)\.attention\.o_proj\.", r"encoder.layer.\1.attention.output.dense."),
             (r"^(?:encoder\.)?layers?\.(\d+)\.relative_position_bias\.",
              r"encoder.layer.\1.attention.attention.relative_position_bias."),
             (r"^(?:encoder\.)?layers?\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
             (r"^(?:encoder\.)?layers?\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
             (r"^(?:encoder\.)?layers?\.(\d+)\.", r"encoder.layer.\1.")]
    import re

    out = {}
    for k, v in sd.items():
        k = k.removeprefix(prefix)
        for pat, rep in rules:
            k, n = re.subn(pat, rep, k)
            if n:
                break
        out[prefix + k] = v
    return out


@pytest.mark.parametrize("family", ["dinov2", "beit"])
def test_transformers_4_names(family):
    """Checkpoints written by transformers 4.x (most of the Hub) convert to the same tensors."""
    if family == "dinov2":
        ref = randomised(transformers.Dinov2Model(transformers.Dinov2Config(**SMALL)))
        prefix, layout = "", "hf_dinov2"
    else:
        ref = randomised(transformers.BeitForImageClassification(transformers.BeitConfig(
            **SMALL, use_relative_position_bias=True, num_labels=5)))
        prefix, layout = "beit.", "hf_beit"
    old = to_v4_names(ref.state_dict(), prefix)
    assert any(".attention.attention.query." in k for k in old)
    new, v4 = converted(ref.state_dict(), layout), converted(old, layout)
    assert new.keys() == v4.keys() and all(torch.equal(new[k], v4[k]) for k in new)
