"""Each model family's own ``model`` section: its keys accepted, another family's refused with one
line naming the layer, the family's keys printed by ``--print-config``, ``model.name=auto``
resolved to the weights' family, and the old flat section (vitflow 892fe07's) still read."""

import dataclasses
import json
import logging

import pytest
import torch
import yaml
from safetensors.torch import save_file

from helpers import take_pretrained
from vitflow.cli import CONFIG_CHECKS, main
from vitflow.config import (
    LEGACY_MODEL_DEFAULTS,
    ConfigError,
    EvaConfig,
    MViTConfig,
    SwinConfig,
    ViTConfig,
    ViTLayoutConfig,
    build_config,
    field_names,
    retype_model,
)
from vitflow.models import FAMILIES, config_class, create_model, model_args

SWIN = "swin_cifar_patch2_window4_32"


def family_config(*overrides, **kw):
    return build_config(overrides=list(overrides), checks=CONFIG_CHECKS, model_config=config_class, **kw)


@pytest.mark.parametrize("name, cls, keys", [
    ("vit_digits_patch2_8", ViTConfig, {"distilled": True, "global_pool": "token", "patch_drop_rate": 0.25}),
    ("deit3_small_patch16_224", ViTLayoutConfig, {"pos_embed": "sincos2d", "attention": "local", "attn_window": 2}),
    ("eva02_tiny_patch14_224", EvaConfig, {"layer_scale_init": 1e-5, "attn_block_size": 64, "global_pool": "token"}),
    (SWIN, SwinConfig, {"window_size": 2, "depths": (1, 1), "num_heads": (2, 4), "attention": "fused"}),
    ("mvitv2_small_cls", MViTConfig, {"depths": (1, 1, 2, 1), "num_heads": 2, "global_pool": "avg",
                                       "attention": "math"}),
])
def test_each_family_takes_its_own_keys(name, cls, keys):
    cfg = family_config(f"model.name={name}", "model.depth=1" if cls in (EvaConfig, ViTLayoutConfig) else
                        "model.embed_dim=8", *(f"model.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
                                               for k, v in keys.items()))
    assert type(cfg.model) is cls and {k: getattr(cfg.model, k) for k in keys} == keys
    if cls is SwinConfig:  # the keys reach the model: two stages of one block, windows of 2
        model = create_model(**model_args(cfg.model, 3))
        assert [len(s.blocks) for s in model.layers] == [1, 1] and model.window_size == 2
        assert [s.blocks[0].attn.num_heads for s in model.layers] == [2, 4]


def test_every_family_names_its_section_class():
    assert {f.name: f.config for f in FAMILIES} == {
        "vit": ViTConfig, "deit3": ViTLayoutConfig, "dinov2": ViTLayoutConfig, "clip": ViTLayoutConfig,
        "siglip": ViTLayoutConfig, "beit": EvaConfig, "eva02": EvaConfig, "dinov3": EvaConfig, "swin": SwinConfig,
        "mvit": MViTConfig}
    assert field_names(SwinConfig)[-3:] == ["depths", "num_heads", "window_size"]
    assert field_names(MViTConfig)[-2:] == ["depths", "num_heads"] and "pos_embed" not in field_names(MViTConfig)
    assert "pos_embed" not in field_names(EvaConfig) and "distilled" not in field_names(ViTLayoutConfig)


def test_another_familys_key_is_refused_in_one_line_naming_the_layer(tmp_path):
    with pytest.raises(ConfigError) as e:
        family_config(f"model.name={SWIN}", "model.patch_drop_rate=0.1")
    assert str(e.value) == (
        f"model.patch_drop_rate is not a key of Swin models (model.name={SWIN}); their keys: name, pretrained, "
        "img_size, num_classes, embed_dim, mlp_ratio, patch_size, global_pool, attention, drop_rate, drop_path_rate, "
        "cpu_bf16_matmul, grad_checkpointing, grad_checkpointing_budget, depths, num_heads, window_size "
        "(in command line)")
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  name: eva02_tiny_patch14_224\n  pos_embed: learned\n")  # even at the old default
    with pytest.raises(ConfigError, match=rf"^model\.pos_embed is not a key of EVA-02 / DINOv3 / BEiT models "
                                          rf"\(model\.name=eva02_tiny_patch14_224\); their keys: .* \(in {f}\)$"):
        family_config(config_file=f)
    with pytest.raises(ConfigError, match=r"model\.window_size is not a key of ViT / DeiT models"):
        family_config("model.window_size=7")
    with pytest.raises(ConfigError, match=r"model\.distilled is not a key of DeiT III / DINOv2 / CLIP / SigLIP"):
        family_config("model.name=deit3_small_patch16_224", "model.distilled=true")
    # a family's narrower values: Swin's windows take no sparse kernel, the ViT has no fused window kernel
    with pytest.raises(ConfigError, match=r"model\.attention='local' is invalid: choose one of \['sdpa', 'math', "
                                          r"'fused', 'auto'\] \(in command line\)"):
        family_config(f"model.name={SWIN}", "model.attention=local")
    with pytest.raises(ConfigError, match=r"model\.attention='fused' is invalid"):
        family_config("model.attention=fused")
    with pytest.raises(ConfigError, match=r"model\.num_heads=\[2\] is invalid: .* 3 and 1 stages"):
        family_config(f"model.name={SWIN}", "model.num_heads=2")
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'swin_cifar_patch2_window5_32'; did you mean "
                                          r"swin_cifar_patch2_window4_32.*\(in command line\)$"):
        family_config("model.name=swin_cifar_patch2_window5_32")


def test_a_presets_keys_for_another_family_are_left_out(caplog):
    """cifar10-vit-tiny is a ViT recipe (pos_embed=sincos2d): naming a Swin keeps what a Swin takes."""
    with caplog.at_level(logging.INFO, logger="vitflow.config"):
        cfg = build_config("cifar10-vit-tiny", overrides=[f"model.name={SWIN}", "data.path=/x"],
                           checks=CONFIG_CHECKS, model_config=config_class)
    assert type(cfg.model) is SwinConfig and (cfg.model.attention, cfg.model.global_pool) == ("math", "avg")
    assert "model.pos_embed='sincos2d' (preset cifar10-vit-tiny) is not a key of Swin models: left out" in caplog.text


def test_print_config_shows_the_chosen_familys_keys(capsys):
    assert main(["train", "--print-config", f"model.name={SWIN}", "model.window_size=2", "model.depths=1,1,1"]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert list(model) == field_names(SwinConfig) and (model["window_size"], model["depths"]) == (2, [1, 1, 1])
    assert main(["train", "--print-config"]) == 0
    assert list(yaml.safe_load(capsys.readouterr().out)["model"]) == field_names(ViTConfig)
    assert main(["train", "--print-config", "model.name=beit_base_patch16_224", "model.pos_embed=relative"]) == 2
    assert capsys.readouterr().err.startswith("error: model.pos_embed is not a key of EVA-02 / DINOv3 / BEiT models")


def swin_snapshot(folder):
    """A transformers Swin snapshot of sizes no named variant has (2 stages of 1 block, window 4)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "swin", "architectures": ["SwinModel"], "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4],
        "window_size": 4, "image_size": 16, "patch_size": 2}))
    save_file({"unused": torch.zeros(1)}, str(folder / "model.safetensors"))  # (only the config is read here)
    return folder


def test_auto_takes_the_weights_family_where_their_config_can_be_read(tmp_path, monkeypatch):
    snap = swin_snapshot(tmp_path / "snap")
    assert config_class("auto", str(snap)) is SwinConfig
    cfg = family_config("model.name=auto", f"model.pretrained={snap}", "model.window_size=2")
    assert type(cfg.model) is SwinConfig and cfg.model.window_size == 2  # a Swin key, accepted before the weights
    take_pretrained(cfg)
    m = cfg.model
    assert (m.name, m.depths, m.num_heads, m.embed_dim, m.window_size, m.img_size) == (
        "swin_tiny_patch4_window7_224", (1, 1), (2, 4), 16, 2, 16)  # the user's window wins
    assert [len(s.blocks) for s in create_model(**model_args(m, 3)).layers] == [1, 1]
    # nothing to read here: a bare file, a hub name not cached (offline): the ViT's section, re-typed later
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert config_class("auto", str(snap / "model.safetensors")) is ViTConfig
    assert config_class("auto", "hf-hub:nobody/nothing") is ViTConfig
    with pytest.raises(ConfigError, match=r"model\.window_size is not a key of ViT / DeiT models \(model\.name=auto\)"
                                          r".*the weights' config could not be read without the network"):
        family_config("model.name=auto", "model.pretrained=hf-hub:nobody/nothing", "model.window_size=2")
    late = build_config(overrides=["model.name=auto", f"model.pretrained={snap}"])  # without the model layer
    assert type(late.model) is ViTConfig
    take_pretrained(late)
    assert type(late.model) is SwinConfig and late.model.depths == (1, 1)


def test_retyping_drops_defaults_and_refuses_values_of_its_own():
    m = retype_model(ViTConfig(name=SWIN, attention="math", drop_path_rate=0.1), SwinConfig)
    assert type(m) is SwinConfig and (m.attention, m.drop_path_rate, m.window_size) == ("math", 0.1, None)
    with pytest.raises(ConfigError, match=r"^model\.depth=3 is not a key of Swin models"):
        retype_model(ViTConfig(name=SWIN, depth=3), SwinConfig)
    with pytest.raises(ConfigError, match=r"model\.attention='local' is invalid"):
        retype_model(ViTConfig(name=SWIN, attention="local"), SwinConfig)


def legacy_section(name, **changes):
    """The flat ``model`` section vitflow 892fe07 wrote for ``name`` (every one of its 25 keys)."""
    return {**LEGACY_MODEL_DEFAULTS, "name": name, **changes}


def test_an_old_flat_section_loads_for_every_family(caplog):
    for name, cls, small in (("vit_digits_patch2_8", ViTConfig, {"depth": 1}),
                             ("deit3_small_patch16_224", ViTLayoutConfig, {"depth": 1}),
                             ("beit_base_patch16_224", EvaConfig, {"depth": 1}), (SWIN, SwinConfig, {"embed_dim": 6})):
        section = legacy_section(name, attention="math", drop_path_rate=0.1, attn_window=5, pos_embed="learned", **small)
        with caplog.at_level(logging.INFO, logger="vitflow"):
            cfg = build_config(base=build_config().to_dict() | {"model": section}, checks=CONFIG_CHECKS,
                               model_config=config_class)
        assert type(cfg.model) is cls and (cfg.model.attention, cfg.model.drop_path_rate) == ("math", 0.1)
        assert dataclasses.asdict(cfg.model).keys() == set(field_names(cls))
        old_args = {k: v for k, v in section.items() if k != "pretrained"} | {"num_classes": 3}  # as saved then
        new, old = create_model(**model_args(cfg.model, 3)), create_model(**old_args)
        assert type(new) is type(old) and new.state_dict().keys() == old.state_dict().keys()
    assert caplog.text == ""  # nothing to say about an old checkpoint's defaults
    bad = build_config().to_dict() | {"model": legacy_section(SWIN, patch_drop_rate=0.1)}
    with pytest.raises(ConfigError, match=r"^model\.patch_drop_rate is not a key of Swin models .*\(in checkpoint "
                                          r"config\)$"):
        build_config(base=bad, model_config=config_class)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) for swin models: patch_drop_rate=0.1 \(their model"):
        create_model(**{**legacy_section(SWIN), "embed_dim": 6, "patch_drop_rate": 0.1})
