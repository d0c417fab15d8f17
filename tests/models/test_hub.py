"""Weights from what users have on disk: bare files, hub snapshot folders (timm, transformers,
OpenCLIP configs), ``hf-hub:`` names through an offline cache the test writes; the generic
loader's adaptation (head reset, position-embedding resampling); one test per bad input, each
one clear line. Nothing touches the network: HF_HUB_OFFLINE=1 and a cache under tmp."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from vitflow.models.pretrained.hub import Pretrained, resolve_pretrained
from vitflow.models.pretrained.weights import adapt_state_dict, load_pretrained
from vitflow.models.vit.model import VisionTransformer

DIMS = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


def vit(num_classes=10, **kw):
    torch.manual_seed(0)
    return VisionTransformer(**{**DIMS, **kw}, num_classes=num_classes).eval()


def timm_config(**pretrained_cfg):
    cfg = {"input_size": [3, 16, 16], "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "crop_pct": 0.9,
           "interpolation": "bilinear", **pretrained_cfg}
    return {"architecture": "vit_tiny_patch16_224", "num_classes": 10, "num_features": 32, "global_pool": "token",
            "pretrained_cfg": cfg, "label_names": [f"c{i}" for i in range(10)]}


def snapshot(folder, model=None, config=None, name="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    if model is not None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / name))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def fake_hub_cache(cache, repo, files_from, revision="0123456789abcdef0123456789abcdef01234567"):
    """huggingface_hub's cache layout: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_bare_file_and_timm_snapshot(tmp_path, caplog):
    """A bare file resolves to itself; a timm snapshot gives its architecture, class names and
    preprocessing; loading it into a 5-class model resets the head, logged, the rest equal."""
    src = vit()
    folder = snapshot(tmp_path / "snap", src, timm_config())
    assert resolve_pretrained(folder / "model.safetensors") == Pretrained(weights=folder / "model.safetensors",
                                                                         source=str(folder / "model.safetensors"))
    pre = resolve_pretrained(folder)
    assert pre.model_name == "vit_tiny_patch16_224" and pre.label_names[3] == "c3"
    assert pre.model_kwargs == {"num_classes": 10, "img_size": 16}
    assert pre.preprocess == {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "crop_pct": 0.9,
                              "interpolation": "bilinear", "input_size": 16}
    model = vit(num_classes=5)
    with caplog.at_level(logging.INFO, logger="vitflow.models.pretrained.weights"):
        load_pretrained(model, str(folder))
    assert "head reset: 10 -> 5 classes" in caplog.text
    assert "keep their initialisation" not in caplog.text  # the head was in the file: reset, not absent
    assert torch.equal(model.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(model.forward_features(x), src.forward_features(x), atol=1e-6)


def test_transformers_and_open_clip_configs(tmp_path):
    """transformers' config.json (model_type) -> a timm name and sizes; preprocessor_config.json ->
    mean/std/size/crop; open_clip_config.json -> name, sizes, preprocessing."""
    folder = snapshot(tmp_path / "dino", vit(), {"model_type": "dinov2_with_registers", "hidden_size": 384,
                                                 "num_hidden_layers": 12, "num_attention_heads": 6, "patch_size": 14,
                                                 "image_size": 518, "intermediate_size": 1536})
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "size": {"shortest_edge": 256},
        "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "resample": 3}))
    pre = resolve_pretrained(folder)
    assert pre.model_name == "vit_small_patch14_reg4_dinov2"
    assert pre.model_kwargs == {"embed_dim": 384, "depth": 12, "num_heads": 6, "patch_size": 14, "img_size": 518,
                                "mlp_ratio": 4.0}
    assert pre.preprocess == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "input_size": 224,
                              "crop_pct": 0.875, "interpolation": "bicubic"}
    siglip = {"model_type": "siglip", "vision_config": {"hidden_size": 768, "num_hidden_layers": 12,
                                                        "num_attention_heads": 12, "patch_size": 16, "image_size": 224}}
    assert resolve_pretrained(snapshot(tmp_path / "sig", vit(), siglip)).model_name == "vit_base_patch16_siglip_224"
    clip = {"model_type": "clip", "projection_dim": 512, "vision_config": {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "patch_size": 32, "image_size": 224,
        "hidden_act": "quick_gelu"}}
    pre = resolve_pretrained(snapshot(tmp_path / "clip", vit(), clip))
    assert pre.model_name == "vit_base_patch32_clip_quickgelu_224" and pre.model_kwargs["num_classes"] == 512
    oc = snapshot(tmp_path / "oc", vit(), name="open_clip_model.safetensors")
    (oc / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": {"embed_dim": 512, "vision_cfg": {"image_size": 224, "layers": 12, "width": 768,
                                                       "patch_size": 16}},
        "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}}))
    pre = resolve_pretrained(oc)
    assert pre.model_name == "vit_base_patch16_clip_224" and pre.weights.name == "open_clip_model.safetensors"
    assert pre.preprocess["std"][0] == 0.26862954 and pre.preprocess["crop_pct"] == 1.0


def test_hf_hub_name_from_offline_cache(tmp_path, offline_hub):
    """``hf-hub:ORG/NAME`` and ``@revision`` resolve through huggingface_hub's cache, offline."""
    src = vit()
    snap = fake_hub_cache(offline_hub, "timm/vit_test.tiny", snapshot(tmp_path / "files", src, timm_config()))
    pre = resolve_pretrained("hf-hub:timm/vit_test.tiny")
    assert pre.weights.resolve() == (snap / "model.safetensors").resolve()
    assert pre.model_name == "vit_tiny_patch16_224"
    assert resolve_pretrained(f"hf-hub:timm/vit_test.tiny@{snap.name}").weights.parent.name == snap.name
    model = vit()
    load_pretrained(model, "hf-hub:timm/vit_test.tiny")
    x = torch.randn(1, 3, 16, 16)
    assert torch.allclose(model(x), src(x), atol=1e-6)


def test_pos_embed_resampled_without_class_position():
    """``no_embed_class`` (DINOv2 +reg4): every row of pos_embed is a grid position; resampled as
    timm resamples it."""
    pytest.importorskip("timm")
    from timm.layers import resample_abs_pos_embed
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    small = TimmViT(img_size=28, patch_size=14, embed_dim=64, depth=1, num_heads=2, reg_tokens=4,
                    no_embed_class=True, num_classes=0)
    big = TimmViT(img_size=56, patch_size=14, embed_dim=64, depth=1, num_heads=2, reg_tokens=4,
                  no_embed_class=True, num_classes=0)
    sd = adapt_state_dict(small.state_dict(), big)
    expected = resample_abs_pos_embed(small.pos_embed, (4, 4), num_prefix_tokens=0)
    assert sd["pos_embed"].shape == (1, 16, 64)
    assert torch.allclose(sd["pos_embed"], expected, atol=1e-5)
    big.load_state_dict(sd, strict=True)


# -- bad input: one clear line each -------------------------------------------------------------

def one_line(err):
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_unknown_layout_lists_names(tmp_path):
    save_file({"encoder.stem.w": torch.zeros(2), "encoder.stage1.w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="unknown layout") as err:
        load_pretrained(vit(), tmp_path / "w.safetensors")
    assert "encoder.stem.w" in one_line(err) and "w.safetensors" in one_line(err)


def test_snapshot_without_weights(tmp_path):
    folder = snapshot(tmp_path / "empty", None, timm_config())
    with pytest.raises(ValueError, match="snapshot folder without weights") as err:
        load_pretrained(vit(), folder)
    assert str(folder) in one_line(err) and "config.json" in one_line(err)


def test_config_disagrees_with_weights(tmp_path):
    """config.json names a width of 32 (the model built from it) but the weights are 48 wide."""
    folder = snapshot(tmp_path / "snap", vit(embed_dim=48), timm_config())
    with pytest.raises(ValueError, match="disagrees with its weights") as err:
        load_pretrained(vit(), folder)
    msg = one_line(err)
    assert "cls_token is (1, 1, 48) in the weights but (1, 1, 32)" in msg and "vit_tiny_patch16_224" in msg


def test_class_count_mismatch_resets_the_head_logged(tmp_path, caplog):
    """Not an error: a 1000-class head into a 5-class model is reset (logged with both counts),
    every other tensor loaded."""
    src = vit(num_classes=1000)
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    model = vit(num_classes=5)
    head = model.head.weight.clone()
    with caplog.at_level(logging.INFO, logger="vitflow.models.pretrained.weights"):
        load_pretrained(model, tmp_path / "w.safetensors")
    assert "head reset: 1000 -> 5 classes" in caplog.text
    assert torch.equal(model.head.weight, head) and torch.equal(model.pos_embed, src.pos_embed)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = _RunsCode()
    evil.marker = marker
    torch.save({"state_dict": {"w": torch.zeros(1)}, "x": evil}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match="refused") as err:
        load_pretrained(vit(), tmp_path / "evil.pth")
    assert "evil.pth" in one_line(err) and "weights_only=False" not in one_line(err)
    assert not marker.exists()


def test_hf_hub_offline_and_not_cached(offline_hub):
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as err:
        load_pretrained(vit(), "hf-hub:someone/missing-model@main")
    msg = one_line(err)
    assert "someone/missing-model" in msg and str(offline_hub) in msg and "HF_HUB_OFFLINE" in msg


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no such file or folder: /nonexistent/w.safetensors"):
        load_pretrained(vit(), "/nonexistent/w.safetensors")


def test_relative_position_tables_resampled_to_another_grid():
    """BEiT's per-block tables of a 2x2 grid fitted to a 3x3 model: resampled, the three
    class-token rows kept, then a strict load."""
    pytest.importorskip("timm")
    from timm.models.beit import Beit

    small = Beit(img_size=28, patch_size=14, embed_dim=64, depth=2, num_heads=2, use_abs_pos_emb=False,
                 use_rel_pos_bias=True, num_classes=0)
    big = Beit(img_size=42, patch_size=14, embed_dim=64, depth=2, num_heads=2, use_abs_pos_emb=False,
               use_rel_pos_bias=True, num_classes=0)
    with torch.no_grad():
        for p in small.parameters():
            p.normal_()
    sd = adapt_state_dict(small.state_dict(), big)
    key = "blocks.1.attn.relative_position_bias_table"
    assert small.state_dict()[key].shape == (12, 2) and sd[key].shape == (28, 2)
    assert torch.equal(sd[key][-3:], small.state_dict()[key][-3:])
    big.load_state_dict(sd, strict=True)


def test_transformers_snapshot_end_to_end_into_vitflow(tmp_path):
    """``Dinov2Model.save_pretrained`` (config.json + model.safetensors) plus a
    preprocessor_config.json -> resolved, converted, loaded strict into vitflow's ViT, same
    features as transformers; the same weights as a bare ``pytorch_model.bin`` load alike."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                                    patch_size=14)
    torch.manual_seed(0)
    ref = transformers.Dinov2Model(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "snap")
    (tmp_path / "snap" / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "size": {"shortest_edge": 32},
        "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "resample": 3}))
    pre = resolve_pretrained(tmp_path / "snap")
    assert pre.model_name == "vit_small_patch14_dinov2" and pre.preprocess["crop_pct"] == 0.875
    sizes = {k: pre.model_kwargs[k] for k in ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio")}
    x = torch.randn(2, 3, 28, 28)
    expected = ref(pixel_values=x).last_hidden_state
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    for spec in (tmp_path / "snap", tmp_path / "pytorch_model.bin"):
        ours = VisionTransformer(**sizes, layer_scale_init=1.0, global_pool="token", num_classes=0).eval()
        load_pretrained(ours, spec)
        assert torch.allclose(ours.forward_features(x), expected, atol=1e-5)


def test_timm_model_args_that_change_no_weights_are_read_past(caplog):
    """A timm config.json's run-time options (dynamic input size, dropout) change no weights: left
    out with a log line; a structural option vitflow cannot build is refused naming it."""
    from vitflow.models.pretrained.timm_args import vitflow_kwargs

    with caplog.at_level(logging.INFO, logger="vitflow.models.pretrained.timm_args"):
        got = vitflow_kwargs({"dynamic_img_size": True, "drop_path_rate": 0.1, "img_size": 224, "init_values": 1e-5},
                             "snap/config.json")
    assert got == {"img_size": 224, "layer_scale_init": 1e-5}
    assert "['drop_path_rate', 'dynamic_img_size'] change no weights" in caplog.text
    with pytest.raises(ValueError, match=r"snap/config.json: model_args \['qk_norm'\]: no vitflow equivalent"):
        vitflow_kwargs({"qk_norm": True}, "snap/config.json")
