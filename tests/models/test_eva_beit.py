"""BEiT, EVA-02 and DINOv3 against timm's models of the same names (random weights, strict load),
at the native size and another one; backends, gradient checkpointing, attention maps and the
model-config keys. Depth is cut to 2 blocks to keep each test a few seconds on a CPU (the
block configuration is the named model's)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import vitflow
from vitflow.config import EvaConfig
from vitflow.models.registry import family_of, model_args

pytestmark = pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm / HF at fp32 rounding

timm = pytest.importorskip("timm")

DEPTH = 2
NUM_CLASSES = 7


@functools.lru_cache(maxsize=None)
def _pair(name: str, img_size: int | None = None):
    """(timm model, vitflow model with its weights), built once per session (timm's RoPE models
    with ``dynamic_img_size``); tests that change a model take a copy."""
    kwargs = dict(img_size=img_size) if img_size else {}
    dynamic = dict(dynamic_img_size=True) if not name.startswith("beit") else {}
    ref = _perturbed_timm(name, **kwargs, **dynamic)
    return ref, _ours_from(ref, name, **kwargs)


def _ours(name: str) -> torch.nn.Module:
    return copy.deepcopy(_pair(name)[1])


def _perturbed_timm(name: str, **kwargs) -> torch.nn.Module:
    """timm's model with random weights where nothing is trivial: LayerScale gammas in [0.3, 1],
    every bias, norm, token, position and bias-table entry moved off its initial value, query and
    key weights large enough for peaked attention (so that RoPE and the relative bias matter)."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, depth=DEPTH, **kwargs).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.split(".")[-1].startswith("gamma"):
                p.uniform_(0.3, 1.0)
            elif n.endswith(("qkv.weight", "q_proj.weight", "k_proj.weight")):  # peaked attention: positions matter
                p.add_(torch.randn_like(p) * 0.15)
            else:
                p.add_(torch.randn_like(p) * (0.1 if p.ndim <= 1 or "table" in n else 0.02))
    return model


def _ours_from(timm_model: torch.nn.Module, name: str, **overrides) -> torch.nn.Module:
    model = vitflow.create_model(name, num_classes=NUM_CLASSES, depth=DEPTH, **overrides).eval()
    model.load_state_dict(timm_model.state_dict(), strict=True)
    return model


def _assert_same(ours: torch.nn.Module, ref: torch.nn.Module, size: int) -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        fo, fr = ours.forward_features(x), ref.forward_features(x)
        # single tokens carry float rounding amplified by the peaked attention; pooled and logits 1e-5
        torch.testing.assert_close(fo, fr, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ours.forward_head(fo, pre_logits=True), ref.forward_head(fr, pre_logits=True),
                                   atol=1e-5, rtol=1e-5)
        logits = ours(x)
        torch.testing.assert_close(logits, ref(x), atol=1e-5, rtol=1e-5)
    assert logits.shape == (1, NUM_CLASSES) and logits.std() > 1e-3


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "eva02_small_patch14_224", "vit_small_patch16_dinov3",
                                  "vit_small_plus_patch16_dinov3_qkvb"])
def test_rope_models_match_timm_native_and_other_size(name):
    ref, ours = _pair(name)
    native = ours.img_size
    _assert_same(ours, ref, native)
    _assert_same(ours, ref, native - 2 * ours.patch_size)  # resampled pos_embed (EVA-02), RoPE for the grid


def test_beit_matches_timm_native_and_other_size():
    name = "beit_base_patch16_224"
    _assert_same(_pair(name)[1], _pair(name)[0], 224)
    ref, ours = _pair(name, 112)  # tables of a 7x7 grid
    _assert_same(ours, ref, 112)


@pytest.mark.parametrize("name", ["eva02_base_patch14_224", "eva02_base_patch16_clip_224"])
def test_eva02_split_qkv_sub_ln_matches_timm(name):
    """Base / large layout: separate q/k/v projections, SwiGLU with sub-LN; the CLIP tower adds
    the attention's inner norm and class-token pooling into its projection head."""
    ref, ours = _pair(name)
    _assert_same(ours, ref, 224)


def test_beit_other_input_size_resamples_tables():
    """The native model on a 112-px input equals the 112-px model given the resampled tables."""
    from vitflow.models.position import resample_relative_table

    ours = _pair("beit_base_patch16_224")[1]
    small = copy.deepcopy(_pair("beit_base_patch16_224", 112)[1])
    sd = {k: resample_relative_table(v, (14, 14), (7, 7)) if k.endswith("table") else v
          for k, v in ours.state_dict().items()}
    small.load_state_dict(sd, strict=True)
    x = torch.randn(1, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), small(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["beit_base_patch16_224", "eva02_tiny_patch14_224",
                                  "vit_small_plus_patch16_dinov3_qkvb"])
def test_backends_agree_and_others_refused(name):
    ours = _ours(name)
    x = torch.randn(1, 3, 112, 112)
    with torch.no_grad():
        ref = ours(x)
        for backend in ("math", "blockwise") + (("auto",) if name.startswith("eva02") else ()):
            ours.set_attention_backend(backend, block_size=16)
            torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=1e-5)
    for backend in ("local", "linformer"):
        with pytest.raises(ValueError, match=f"attention={backend} is not available"):
            ours.set_attention_backend(backend)


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "beit_base_patch16_224", "vit_small_patch16_dinov3"])
def test_grad_checkpointing_same_gradients(name):
    ours = _ours(name).train()
    side = 4 * ours.patch_size
    x = torch.randn(2, 3, side, side)

    def grads() -> dict[str, torch.Tensor]:
        ours.zero_grad()
        ours(x).square().sum().backward()
        return {n: p.grad.clone() for n, p in ours.named_parameters()}

    plain = grads()
    ours.set_grad_checkpointing(True)
    assert all(blk.grad_checkpointing for blk in ours.blocks)
    for n, g in grads().items():
        torch.testing.assert_close(g, plain[n], atol=1e-6, rtol=1e-5, msg=n)


def test_attention_maps_shapes_and_rows():
    ours = vitflow.create_model("vit_small_patch16_dinov3", depth=3).eval()
    with torch.no_grad():
        maps = ours.attention_maps(torch.randn(2, 3, 64, 64), layers=[0, -1])
    assert [m.shape for m in maps] == [(2, 6, 5 + 16, 5 + 16)] * 2  # class + 4 registers + 4x4 patches
    torch.testing.assert_close(maps[1].sum(-1), torch.ones(2, 6, 21))
    with torch.no_grad():
        (m,) = _pair("beit_base_patch16_224")[1].attention_maps(torch.randn(1, 3, 224, 224), layers=0)
    assert m.shape == (1, 12, 197, 197)


@pytest.mark.parametrize("name", ["beit_base_patch16_224", "eva02_tiny_patch14_224", "vit_small_patch16_dinov3"])
def test_every_model_config_key_reaches_build(name):
    args = model_args(EvaConfig(name=name, depth=1, grad_checkpointing="all", drop_path_rate=0.1), NUM_CLASSES)
    model = vitflow.create_model(**args)
    assert model.num_classes == NUM_CLASSES and model.grad_checkpointing and len(model.blocks) == 1
    assert family_of(name).load_pretrained is not None


@pytest.mark.parametrize("key, value", [("pos_embed", "sincos2d"), ("weight_init", "jax"), ("patch_drop_rate", 0.1),
                                        ("distilled", True), ("attention", "performer")])
def test_unsupported_config_values_refused(key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r}" if key != "attention" else "attention=performer"):
        vitflow.create_model("eva02_tiny_patch14_224", depth=1, **{key: value})


def test_weight_decay_names_and_layer_ids():
    from vitflow.training.optim.optimizers import layer_id

    beit = _pair("beit_base_patch16_224")[1]
    assert "blocks.1.attn.relative_position_bias_table" in beit.no_weight_decay()
    dino = vitflow.create_model("vit_small_patch16_dinov3", depth=2)
    assert {"reg_token", "cls_token"} <= dino.no_weight_decay()
    ids = {n: layer_id(n, 2) for n, _ in dino.named_parameters()}
    assert ids["reg_token"] == ids["cls_token"] == ids["patch_embed.proj.weight"] == 0
    assert ids["blocks.1.gamma_2"] == 2 and ids["norm.weight"] == ids["head.weight"] == 3 if "head.weight" in ids \
        else ids["norm.weight"] == 3


def test_timm_weights_file_loads_with_head_reset_and_resampling(tmp_path):
    """A timm-named .safetensors through create_model(pretrained=...) at another size and class
    count: EVA-02's pos_embed resampled, the head reset; the rest is timm's weights."""
    from vitflow.models.pretrained.weights import save_safetensors

    ref = _pair("eva02_tiny_patch14_224")[0]
    save_safetensors(ref, tmp_path / "eva.safetensors")
    model = vitflow.create_model("eva02_tiny_patch14_224", pretrained=tmp_path / "eva.safetensors", depth=DEPTH,
                                 num_classes=3, img_size=112)
    assert model.pos_embed.shape == (1, 65, 192) and model.head.out_features == 3
    torch.testing.assert_close(model.blocks[1].attn.q_bias, ref.blocks[1].attn.q_bias)


def test_eva02_onnx_export_matches(tmp_path):
    """ONNX export of an EVA-02 model (RoPE, SwiGLU, q/v bias; the math backend in the export
    copy), ONE export with a dynamic batch run at batch 1 and 3."""
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from vitflow.data.transforms import Preprocess
    from vitflow.infer.export.formats import export_onnx, verify
    from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel

    model = copy.deepcopy(_pair("eva02_tiny_patch14_224", 112)[1])
    info = ModelInfo([f"c{i}" for i in range(NUM_CLASSES)], Preprocess(112, 1.0),
                     {"name": "eva02_tiny_patch14_224", "num_classes": NUM_CLASSES, "depth": DEPTH, "img_size": 112})
    path = export_onnx(model, tmp_path / "eva02.onnx", info)
    x = torch.randn(3, 3, 112, 112)
    check = verify(model, OnnxModel(path), x, batch_sizes=(1, 3), tolerance=1e-4)
    assert check.ok, check.summary()
    with torch.no_grad():
        assert model(x).abs().max() > 0.05  # a real comparison, not of near-zero logits


def test_dynamic_int8_runs_close_to_float():
    from vitflow.infer.quantize.dynamic import quantize_torch

    torch.manual_seed(3)
    model = vitflow.create_model("beit_base_patch16_224", num_classes=NUM_CLASSES, depth=DEPTH, img_size=112).eval()
    with torch.no_grad():  # moderate random weights (the parity tests' peaked attention amplifies int8 noise)
        for n, p in model.named_parameters():
            p.uniform_(0.3, 1.0) if n.split(".")[-1].startswith("gamma") else p.add_(torch.randn_like(p) * 0.02)
    x = torch.randn(1, 3, 112, 112)
    with torch.no_grad():
        ref, q = model(x), quantize_torch(model)(x)
    assert (q - ref).abs().max() < 0.1 * ref.abs().max()
    assert torch.corrcoef(torch.stack([q.flatten(), ref.flatten()]))[0, 1] > 0.99


def test_pruning_refused():
    from vitflow.infer.prune.checkpoint import _calibrate_and_prune

    model = vitflow.create_model("eva02_tiny_patch14_224", depth=1)
    state = {"path": "run/best.pt", "model_args": {"name": "eva02_tiny_patch14_224"}}
    with pytest.raises(ValueError, match="run/best.pt: eva02_tiny_patch14_224 cannot be pruned"):
        _calibrate_and_prune(model, state, None, None, None, 8, (0, 0.25, 0.0), print)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) for eva02 models: block_heads=\[1\]"):
        vitflow.create_model("eva02_tiny_patch14_224", depth=1, block_heads=[1])
    with pytest.raises(ValueError, match="unknown argument.*foo"):
        vitflow.create_model("beit_base_patch16_224", depth=1, foo=1)
