import re

import numpy as np
import pytest
import torch

import vitflow
from vitflow.models.convert.vit import convert_hf_vit, convert_jax_npz, read_npz, save_jax_npz, to_jax_npz_arrays
from vitflow.models.pretrained.weights import load_pretrained, read_state_dict

transformers = pytest.importorskip("transformers")


def hf_model(num_labels=7):
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=3, num_attention_heads=3, intermediate_size=384,
                                 image_size=32, patch_size=4, num_labels=num_labels, layer_norm_eps=1e-6,
                                 hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():  # HF initialises the class token / position embeddings small: make them count
        model.vit.embeddings.cls_token.normal_()
        model.vit.embeddings.position_embeddings.normal_(std=0.5)
    return model


def ours_like_hf(num_classes=7, **kw):
    return vitflow.VisionTransformer(img_size=32, patch_size=4, embed_dim=192, depth=3, num_heads=3, mlp_ratio=2.0,
                                     num_classes=num_classes, **kw).eval()


def to_v4_names(sd):
    """transformers 5.x ViT names -> the 4.x names of the checkpoints on the Hub."""
    rules = [(r"vit\.layers\.(\d+)\.attention\.([qkv])_proj\.",
              lambda m: f"vit.encoder.layer.{m[1]}.attention.attention."
                        f"{dict(q='query', k='key', v='value')[m[2]]}."),
             (r"vit\.layers\.(\d+)\.attention\.o_proj\.", r"vit.encoder.layer.\1.attention.output.dense."),
             (r"vit\.layers\.(\d+)\.mlp\.fc1\.", r"vit.encoder.layer.\1.intermediate.dense."),
             (r"vit\.layers\.(\d+)\.mlp\.fc2\.", r"vit.encoder.layer.\1.output.dense."),
             (r"vit\.layers\.(\d+)\.", r"vit.encoder.layer.\1.")]
    out = {}
    for k, v in sd.items():
        for pat, rep in rules:
            k2 = re.sub(pat, rep, k)
            if k2 != k:
                k = k2
                break
        out[k] = v
    return out


class _Pickled:  # a class, so torch.save pickles an object weights_only loading refuses
    pass


@pytest.mark.parametrize("names", ["v5", "v4"])
@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_hugging_face_vit_converts_with_logit_parity(names, attention):
    ref = hf_model()
    sd = ref.state_dict() if names == "v5" else to_v4_names(ref.state_dict())
    if names == "v4":
        assert any(".attention.attention.query." in k for k in sd)
    ours = ours_like_hf(attention=attention)
    ours.load_state_dict(convert_hf_vit(sd), strict=True)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = ref(pixel_values=x).logits
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
    assert expected.std() > 1e-2


def test_hugging_face_file_loads_through_create_model(tmp_path):
    from safetensors.torch import save_file

    ref = hf_model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    ours = vitflow.create_model("vit_cifar_patch4_32", depth=3, num_classes=7, pretrained=path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(pixel_values=x).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no vitflow counterpart"):
        convert_hf_vit({**ref.state_dict(), "vit.encoder.layer.0.attention.attention.rotary.weight": torch.zeros(1)})


def test_npz_round_trip_through_the_documented_mapping(tmp_path):
    torch.manual_seed(0)
    src = ours_like_hf(num_classes=5)
    with torch.no_grad():
        src.cls_token.normal_()
    path = tmp_path / "vit.npz"
    save_jax_npz(src, path)
    arrays = read_npz(path)
    # the Flax shapes of the documented mapping
    assert arrays["embedding/kernel"].shape == (4, 4, 3, 192)
    assert arrays["Transformer/encoderblock_2/MultiHeadDotProductAttention_1/query/kernel"].shape == (192, 3, 64)
    assert arrays["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/out/kernel"].shape == (3, 64, 192)
    assert arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"].shape == (192, 384)
    back = read_state_dict(path)
    own = src.state_dict()
    assert back.keys() == own.keys()
    for k in own:
        assert torch.equal(back[k], own[k]), k
    loaded = vitflow.create_model("vit_cifar_patch4_32", depth=3, num_classes=5, pretrained=path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), src(x))


def test_npz_mapping_agrees_with_timms_loader(tmp_path):
    """An independent reader of Google's format: timm's _load_weights on our .npz gives our logits."""
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer as TimmViT
    from timm.models.vision_transformer import _load_weights

    torch.manual_seed(0)
    src = ours_like_hf(num_classes=5)
    path = tmp_path / "vit.npz"
    save_jax_npz(src, path)
    ref = TimmViT(img_size=32, patch_size=4, embed_dim=192, depth=3, num_heads=3, mlp_ratio=2.0,
                  num_classes=5).eval()
    with torch.no_grad():
        _load_weights(ref, str(path))
        x = torch.randn(2, 3, 32, 32)
        torch.testing.assert_close(src(x), ref(x), atol=1e-5, rtol=0)


def test_big_vision_scanned_npz_converts():
    torch.manual_seed(0)
    src = ours_like_hf(num_classes=5)
    vt = to_jax_npz_arrays(src.state_dict(), num_heads=3)
    bv = {"params/img/embedding/kernel": vt["embedding/kernel"], "params/img/embedding/bias": vt["embedding/bias"],
          "params/img/cls": vt["cls"], "params/img/pos_embedding": vt["Transformer/posembed_input/pos_embedding"],
          "params/img/head/kernel": vt["head/kernel"], "params/img/head/bias": vt["head/bias"]}
    for k in ("scale", "bias"):
        bv[f"params/img/Transformer/encoder_norm/{k}"] = vt[f"Transformer/encoder_norm/{k}"]
    renames = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0", "LayerNorm_2": "LayerNorm_1",
               "MlpBlock_3": "MlpBlock_0"}
    per_block = {}
    for k, v in vt.items():
        if m := re.match(r"Transformer/encoderblock_(\d+)/(.*)", k):
            sub = m[2]
            for a, b in renames.items():
                sub = sub.replace(a, b)
            per_block.setdefault(sub, {})[int(m[1])] = v
    for sub, by_layer in per_block.items():  # scan: one stacked array per parameter
        bv[f"params/img/Transformer/encoderblock/{sub}"] = np.stack([by_layer[i] for i in range(3)])
    sd = convert_jax_npz(bv)
    for k, v in src.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_npz_errors_name_the_problem(tmp_path):
    bad = tmp_path / "other.npz"
    np.savez(bad, weights=np.zeros(3))
    with pytest.raises(ValueError, match="other.npz.*embedding/kernel"):
        read_state_dict(bad)
    src = ours_like_hf(num_classes=5)
    arrays = to_jax_npz_arrays(src.state_dict(), 3)
    del arrays["cls"]
    with pytest.raises(ValueError, match="average-pooled"):
        convert_jax_npz(arrays)
    with pytest.raises(ValueError, match="no counterpart"):
        to_jax_npz_arrays(ours_like_hf(layer_scale_init=0.1).state_dict(), 3)


def test_pretrained_into_relative_and_linformer_models(tmp_path):
    """Fine-tuning starts: a plain ViT file into a model with new attention parameters."""
    from vitflow.models.pretrained.weights import save_safetensors

    src = vitflow.create_model("vit_cifar_patch4_32", num_classes=10)
    path = tmp_path / "w.safetensors"
    save_safetensors(src, path)
    rel = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, pos_embed="relative", pretrained=path)
    assert torch.equal(rel.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    lin = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, attention="linformer", pretrained=path)
    assert torch.equal(lin.blocks[1].mlp.fc1.weight, src.blocks[1].mlp.fc1.weight)
    save_safetensors(rel, tmp_path / "rel.safetensors")  # relative tables resampled for a bigger grid
    big = vitflow.create_model("vit_cifar_patch4_32", num_classes=10, pos_embed="relative", img_size=48,
                               pretrained=tmp_path / "rel.safetensors")
    assert big.blocks[0].attn.rel_pos.relative_position_bias_table.shape == (23 * 23 + 3, 3)
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(vitflow.create_model("vit_cifar_patch4_32", num_classes=10, layer_scale_init=0.1), path)


def test_unreadable_weights_files_give_one_short_line(tmp_path):
    """Not a weights file, an ONNX model, a pickle with objects, a truncated zip: one line each,
    naming the file and why, never torch's advice to load with weights_only=False."""
    (tmp_path / "notes.pt").write_text("hello\n")
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07")
    torch.save({"a": _Pickled()}, tmp_path / "objects.pt")
    torch.save({"w": torch.zeros(2)}, tmp_path / "ok.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:60])
    expected = {"notes.pt": r"not a PyTorch file \(it starts with b'hello\\n'\)", "m.onnx": "is an ONNX model, not weights",
                "objects.pt": r"holding pickled objects other than tensors \(refused.*Unsupported global",
                "cut.pt": "failed reading zip archive"}
    for name, pattern in expected.items():
        with pytest.raises(ValueError, match=pattern) as err:
            read_state_dict(tmp_path / name)
        msg = str(err.value)
        assert name in msg and "\n" not in msg and "weights_only=False" not in msg
        assert len(msg.replace(str(tmp_path), "")) < 260, msg
    assert torch.equal(read_state_dict(tmp_path / "ok.pt")["w"], torch.zeros(2))


def test_weights_of_another_depth_name_the_block_counts(tmp_path):
    """A file of 2 blocks into a model of 3: the error says both counts and the key to set."""
    from vitflow.models.pretrained.weights import save_safetensors

    save_safetensors(vitflow.create_model("vit_tiny_patch16_224", depth=2, num_classes=3), tmp_path / "d2.safetensors")
    with pytest.raises(ValueError, match=r"the file has 2 blocks, the model 3: model\.depth=2\?"):
        vitflow.create_model("vit_tiny_patch16_224", depth=3, num_classes=3, pretrained=tmp_path / "d2.safetensors")
