"""Hugging Face Swin / Swin V2 -> timm names, config.json -> timm model name, and Swin window
resampling at load time.

Parity: a random-initialised ``SwinForImageClassification`` / ``Swinv2ForImageClassification``
(tiny configs: 64 px, patch 4, window 4, two stages of two blocks, so every stage has a shifted
block, one patch merging, and V2's continuous position bias with a pretrained window) is
converted and loaded with ``strict=True`` into timm's model of the sizes its config.json names,
which must give the same logits (1e-5, fp32). Resampling: equal (1e-6) to timm's own
``checkpoint_filter_fn``. The vitflow-side end-to-end test runs once the Swin family
(``vitflow.models.swin.model``) is merged.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from vitflow.config import Config, ConfigError
from vitflow.models.convert.hf_swin import (
    detect_hf_swin,
    hf_swin_model_args,
    hf_swin_to_timm,
    swin_model_config_keys,
)
from vitflow.models.pretrained.hub import resolve_pretrained
from vitflow.models.pretrained.swin_fit import adapt_swin_state_dict, is_swin_model, resample_swin_table
from vitflow.models.pretrained.weights import detect_layout, load_pretrained, read_state_dict

pytestmark = pytest.mark.usefixtures("torch_fp32_gemm")  # compared with timm / HF at fp32 rounding

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

TINY = dict(image_size=64, patch_size=4, embed_dim=24, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=5)
TOL = dict(atol=1e-5, rtol=1e-5)
_HF4 = [("attention.q_proj", "attention.self.query"), ("attention.k_proj", "attention.self.key"),
        ("attention.v_proj", "attention.self.value"), ("attention.o_proj", "attention.output.dense"),
        ("attention.relative_position_bias.relative_position_bias_table",
         "attention.self.relative_position_bias_table"),
        ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense")]


@pytest.fixture(params=["swin", "swinv2"])
def version(request):
    return request.param


def hf_model(version, bare=False, **sizes):
    """A random-initialised transformers Swin (V1 / V2) classifier, or the bare backbone, with
    every parameter moved off its initial value (zero tables and biases, unit norms would hide a
    mix-up), in eval mode, and its config.json as a dict."""
    from transformers import (
        SwinConfig,
        SwinForImageClassification,
        SwinModel,
        Swinv2Config,
        Swinv2ForImageClassification,
        Swinv2Model,
    )

    v2 = version == "swinv2"
    extra = {"pretrained_window_sizes": [3, 3]} if v2 else {}
    cfg = (Swinv2Config if v2 else SwinConfig)(**{**TINY, **sizes}, **extra)
    cls = {(False, False): SwinForImageClassification, (False, True): SwinModel,
           (True, False): Swinv2ForImageClassification, (True, True): Swinv2Model}[(v2, bare)]
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    config = {**cfg.to_dict(), "architectures": [cls.__name__]}
    return model.eval(), config


def hf_logits(model, x):
    with torch.no_grad():
        out = model(pixel_values=x)
    return out.logits if hasattr(out, "logits") else out.pooler_output


def timm_model(config, **overrides):
    name, kwargs = hf_swin_model_args(config)
    return timm.create_model(name, pretrained=False, **{**kwargs, **overrides}).eval()


def test_hf_swin_to_timm_same_logits(version):
    hf, config = hf_model(version)
    sd = hf.state_dict()
    assert detect_layout(sd) == f"hf_{version}"
    model = timm_model(config)
    model.load_state_dict(hf_swin_to_timm(sd, config), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(hf, x), **TOL)
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Block")]
    assert any(any(b.shift_size) for b in blocks), "the tiny config must have a shifted-window block"


def test_bare_backbone_without_prefix_or_head(version):
    hf, config = hf_model(version, bare=True)
    sd = hf.state_dict()
    assert not any(k.startswith(("swin.", "swinv2.", "classifier")) for k in sd)
    model = timm_model(config, num_classes=0)
    model.load_state_dict(hf_swin_to_timm(sd), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(hf, x), **TOL)


def test_transformers4_names_convert_alike():
    """The Hub's checkpoints carry transformers 4.x names (attention.self.query, intermediate.dense,
    persistent relative_position_index): they convert to the same tensors as the 5.x names."""
    hf, config = hf_model("swin")
    sd5 = hf.state_dict()
    sd4 = {}
    for k, v in sd5.items():
        for new, old in _HF4:
            k = k.replace(new, old)
        sd4[k] = v
        if k.endswith("relative_position_bias_table"):
            sd4[k.replace("_bias_table", "_index")] = torch.zeros(16, 16, dtype=torch.long)
    assert any("attention.self.query" in k for k in sd4) and detect_layout(sd4) == "hf_swin"
    a, b = hf_swin_to_timm(sd5), hf_swin_to_timm(sd4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_conversion_errors():
    hf, config = hf_model("swin")
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="model_type 'swinv2'"):
        hf_swin_to_timm(sd, {**config, "model_type": "swinv2"})
    with pytest.raises(ValueError, match="position_embeddings"):
        hf_swin_to_timm({**sd, "swin.embeddings.position_embeddings": torch.zeros(1, 256, 24)})
    with pytest.raises(ValueError, match="unknown Hugging Face Swin parameters.*extra"):
        hf_swin_to_timm({**sd, "swin.encoder.layers.0.blocks.0.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="need query/key/value"):
        hf_swin_to_timm({k: v for k, v in sd.items() if "blocks.1.attention.k_proj" not in k})
    assert detect_hf_swin({"embeddings.patch_embeddings.projection.weight", "encoder.layer.0.x"}) is None


@pytest.mark.parametrize("config, name, kwargs", [
    ({"model_type": "swin", "architectures": ["SwinForImageClassification"], "id2label": {str(i): str(i) for i in
                                                                                          range(1000)}},
     "swin_tiny_patch4_window7_224", {"img_size": 224, "num_classes": 1000}),
    ({"model_type": "swin", "embed_dim": 128, "depths": [2, 2, 18, 2], "num_heads": [4, 8, 16, 32],
      "window_size": 12, "image_size": 384}, "swin_base_patch4_window12_384", {"img_size": 384}),
    ({"model_type": "swinv2", "window_size": 8, "image_size": 256, "pretrained_window_sizes": [0, 0, 0, 0]},
     "swinv2_tiny_window8_256", {"img_size": 256}),
    ({"model_type": "swinv2", "embed_dim": 192, "depths": [2, 2, 18, 2], "num_heads": [6, 12, 24, 48],
      "window_size": 16, "image_size": 256, "pretrained_window_sizes": [12, 12, 12, 6]},
     "swinv2_large_window12to16_192to256", {"img_size": 256}),
    ({"model_type": "swin", "embed_dim": 96, "depths": [2, 2, 18, 2], "window_size": 7, "image_size": 448},
     "swin_small_patch4_window7_224", {"img_size": 448}),
    ({"model_type": "swin", "embed_dim": 32, "depths": [2, 2], "num_heads": [2, 4], "window_size": 4,
      "image_size": 32, "patch_size": 2, "mlp_ratio": 2.0},
     "swin_tiny_patch4_window7_224", {"embed_dim": 32, "depths": (2, 2), "num_heads": (2, 4), "window_size": 4,
                                      "patch_size": 2, "mlp_ratio": 2.0, "img_size": 32}),
])
def test_config_to_timm_name(config, name, kwargs):
    got = hf_swin_model_args(config)
    assert got == (name, kwargs)
    assert name in timm.list_models("swin*")


@pytest.mark.parametrize("bad, match", [({"use_absolute_embeddings": True}, "use_absolute_embeddings"),
                                        ({"window_size": [7, 8]}, "not square"),
                                        ({"hidden_act": "relu"}, "GELU"),
                                        ({"depths": [2, 2]}, "differ in length"),
                                        ({"model_type": "vit"}, "not a Swin")])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        hf_swin_model_args({"model_type": "swin", **bad}, "snap/config.json")


def test_model_config_keys_refuse_what_modelconfig_cannot_hold():
    m = Config().model
    assert swin_model_config_keys({"embed_dim": 32, "img_size": 64, "num_classes": 3}, m, set()) == {"embed_dim": 32}
    assert swin_model_config_keys({"embed_dim": 32}, m, {"model.embed_dim"}) == {}
    with pytest.raises(ConfigError, match=r"depths=\[1, 1\]"):
        swin_model_config_keys({"embed_dim": 32, "depths": (1, 1)}, m, set())


def write_snapshot(folder, hf, config):
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def test_snapshot_folder_through_vitflow_loader(tmp_path, version, caplog):
    """config.json + model.safetensors: resolve_pretrained names the timm architecture and
    vitflow's generic loader (read, detect, convert, adapt, strict load) fills timm's model with
    it, same logits; a model of window 8 gets resampled V1 tables (equal to timm's filter)."""
    hf, config = hf_model(version)
    folder = write_snapshot(tmp_path / "snap", hf, config)
    pre = resolve_pretrained(folder)
    assert (pre.model_name, pre.model_kwargs) == hf_swin_model_args(config)
    assert pre.model_kwargs["num_classes"] == 5 and pre.label_names == [f"LABEL_{i}" for i in range(5)]
    model = timm_model(config)
    load_pretrained(model, folder)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(hf, x), **TOL)
    big = timm_model(config, window_size=8)
    with caplog.at_level(logging.INFO, logger="vitflow"):
        load_pretrained(big, folder)
    if version == "swin":
        assert "relative_position_bias_table: window 4 -> 8 (resampled) in 4 blocks" in caplog.text
        ref = timm.models.swin_transformer.checkpoint_filter_fn(read_state_dict(folder / "model.safetensors"), big)
        for k, v in big.state_dict().items():
            if k.endswith("relative_position_bias_table"):
                torch.testing.assert_close(v, ref[k], atol=1e-6, rtol=0)
    else:
        assert "continuous position bias" in caplog.text


def test_bare_hf_state_dict_file(tmp_path):
    """A lone .pth in Hugging Face names (no config) is detected and converted by read_state_dict."""
    hf, config = hf_model("swinv2", bare=True)
    torch.save(hf.state_dict(), tmp_path / "w.pth")
    sd = read_state_dict(tmp_path / "w.pth", known_layout=True)
    model = timm_model(config, num_classes=0)
    model.load_state_dict(sd, strict=True)
    assert is_swin_model(model)


def tiny_timm(version, window, img, **kw):
    name = "swin_tiny_patch4_window7_224" if version == "swin" else "swinv2_tiny_window8_256"
    sizes = dict(img_size=img, window_size=window, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=3)
    return timm.create_model(name, **{**sizes, **kw}).eval()


@pytest.mark.parametrize("old, new", [((7, 56), (8, 64)), ((8, 64), (7, 56)), ((4, 64), (8, 64))])
def test_resample_equals_timm_filter(old, new, caplog):
    from timm.models.swin_transformer import checkpoint_filter_fn

    torch.manual_seed(0)
    src = tiny_timm("swin", *old)
    with torch.no_grad():
        for n, p in src.named_parameters():
            if n.endswith("relative_position_bias_table"):
                p.normal_()  # values of order 1: a 1e-6 agreement is meaningful
    dst = tiny_timm("swin", *new)
    sd = src.state_dict()
    with caplog.at_level(logging.INFO, logger="vitflow"):
        mine = adapt_swin_state_dict(sd, dst)
    ref = checkpoint_filter_fn(dict(sd), dst)
    assert mine.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=1e-6, rtol=0)
    assert f"relative_position_bias_table: window {old[0]} -> {new[0]} (resampled) in 4 blocks" in caplog.text
    dst.load_state_dict(mine, strict=True)


def test_resample_table_properties():
    table = torch.randn(13 * 13, 3)
    assert resample_swin_table(table, (7, 7)) is table
    assert resample_swin_table(table, (8, 8)).shape == (15 * 15, 3)
    # the centre offset (0, 0) keeps its value in both modes; a constant table stays constant
    for mode in ("timm", "bicubic"):
        out = resample_swin_table(table, (10, 10), mode=mode).reshape(19, 19, 3)
        torch.testing.assert_close(out[9, 9], table.reshape(13, 13, 3)[6, 6], atol=1e-5, rtol=0)
        flat = resample_swin_table(torch.full((169, 2), 0.7), (10, 10), mode=mode)
        torch.testing.assert_close(flat, torch.full_like(flat, 0.7), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="not \\(2W-1\\)\\^2"):
        resample_swin_table(torch.zeros(170, 2), (8, 8))


def test_adapt_v2_and_original_layout(caplog):
    """V2: only rebuilt buffers go (same as timm's V2 filter), the model at another window with
    pretrained_window_sizes loads; Microsoft's layout (downsample at a stage's end, head.weight)
    lands in timm's; a head of another class count is dropped."""
    from timm.models.swin_transformer_v2 import checkpoint_filter_fn

    src = tiny_timm("swinv2", 4, 64)
    sd = {**src.state_dict(), "layers.0.blocks.0.attn.relative_coords_table": torch.zeros(1, 7, 7, 2)}
    dst = tiny_timm("swinv2", 8, 64, pretrained_window_sizes=(4, 4))
    with caplog.at_level(logging.INFO, logger="vitflow"):
        mine, ref = adapt_swin_state_dict(sd, dst), checkpoint_filter_fn(dict(sd), dst)
    assert "Swin V2 window 4 -> 8: continuous position bias (cpb_mlp), nothing to resample" in caplog.text
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    dst.load_state_dict(mine, strict=True)
    v1 = tiny_timm("swin", 7, 56)
    timm_sd = v1.state_dict()
    original = {}
    for k, v in timm_sd.items():
        k = k.replace("layers.1.downsample", "layers.0.downsample").replace("head.fc.", "head.")
        original[k] = v
    back = adapt_swin_state_dict(original, v1)
    assert back.keys() == timm_sd.keys() and all(torch.equal(back[k], timm_sd[k]) for k in back)
    other = tiny_timm("swin", 7, 56, num_classes=10)
    assert not any(k.startswith("head.fc") for k in adapt_swin_state_dict(timm_sd, other))


def test_vitflow_swin_end_to_end(tmp_path, version):
    """Once the Swin family is merged: the snapshot builds vitflow's own model (architecture from
    config.json), which gives Hugging Face's logits."""
    pytest.importorskip("vitflow.models.swin.model")
    from vitflow.models.pretrained.config import create_pretrained_model

    hf, config = hf_model(version)
    folder = write_snapshot(tmp_path / "snap", hf, config)
    model, pre = create_pretrained_model(str(folder))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), hf_logits(hf, x), **TOL)
    assert pre.label_names == [f"LABEL_{i}" for i in range(5)]
