import pytest

from vitflow.cli import CONFIG_CHECKS
from vitflow.config import ConfigError, build_config, list_presets, parse_duration, parse_override, to_yaml


def test_defaults_are_the_digits_preset():
    cfg = build_config()
    assert cfg.preset == "digits-vit-tiny"
    assert cfg.data.source == "digits"


def test_required_presets_exist_with_their_recipes():
    presets = list_presets()
    for name in ("digits-vit-tiny", "cifar10-vit-tiny", "cifar10-vit-b16-ft384", "imagenet2012-vit-b16"):
        assert name in presets and presets[name]
    ft = build_config("cifar10-vit-b16-ft384", overrides=["data.path=/x"])
    assert (ft.train.total_steps, ft.data.train_split, ft.data.test_split) == (10_000, "train[:98%]", "test")
    assert (ft.train.batch_size, ft.train.accum_steps, ft.data.prefetch) == (512, 8, 2)
    assert ft.model.img_size == 384
    inet = build_config("imagenet2012-vit-b16", overrides=["data.path=/x"])
    assert (inet.train.total_steps, inet.data.train_split, inet.data.test_split) == (20_000, "train[:99%]",
                                                                                       "validation")


def test_overrides_are_typed():
    cfg = build_config(overrides=["optim.lr=3e-4", "train.batch_size=32", "data.hflip=true",
                                  "data.mean=0.1,0.2,0.3", "optim.clip_grad_norm=null", "train.total_steps=1_000"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.batch_size == 32 and cfg.data.hflip is True
    assert cfg.data.mean == (0.1, 0.2, 0.3)
    assert cfg.optim.clip_grad_norm is None
    assert cfg.train.total_steps == 1000


@pytest.mark.parametrize("override,message", [
    ("train.batch_sise=3", "did you mean 'train.batch_size'"),
    ("train.lr=0.1", "did you mean 'optim.lr'"),
    ("trian.seed=1", "did you mean 'train.seed'"),
    ("model.nme=vit", "did you mean 'model.name'"),
])
def test_unknown_key_names_key_and_nearest(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        build_config(overrides=[override])
    assert override.split("=")[0] in str(e.value)


@pytest.mark.parametrize("override,key", [
    ("train.batch_size=abc", "train.batch_size"),
    ("train.batch_size=-4", "train.batch_size"),
    ("optim.lr=0", "optim.lr"),
    ("train.precision=fp8", "train.precision"),
    ("model.name=vit_tiny_patch16_244", "model.name"),
    ("data.train_split=train[:98", "data.train_split"),
    ("train.time_budget=soon", "train.time_budget"),
    ("data.mean=0.1,0.2", "data.mean"),
    ("train.batch_size=100", "train.batch_size"),  # with accum_steps=8 below: not a multiple
    ("model.img_size=31", "model.img_size"),  # the default variant's patch is 2: not a multiple
])
def test_bad_values_name_the_key(override, key):
    overrides = [override, "train.accum_steps=8"] if override.endswith("=100") else [override]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        build_config(overrides=overrides, checks=CONFIG_CHECKS)
    assert str(e.value).endswith("(in command line)")  # where the bad value came from


def test_precision_choice_suggests_nearest():
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        build_config(overrides=["train.precision=bf61"])


def test_config_file_layers_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  total_steps: 7\noptim:\n  lr: 0.5\n")
    cfg = build_config(config_file=f, overrides=["train.total_steps=9"])
    assert (cfg.train.total_steps, cfg.optim.lr) == (9, 0.5)
    f.write_text("train:\n  total_stepz: 7\n")
    with pytest.raises(ConfigError, match=r"total_stepz.*did you mean 'train.total_steps'.*c\.yaml"):
        build_config(config_file=f)
    with pytest.raises(ConfigError, match="not found"):
        build_config(config_file=tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="unknown preset 'cifar10-vit-tiy'; did you mean cifar10-vit-tiny"):
        build_config("cifar10-vit-tiy")
    f.write_text("train: [1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not valid YAML \(line 2, column 1\): expected ',' or ']'"):
        build_config(config_file=f)
    # the default preset trains on the embedded digits: a data.path there would be silently unused
    with pytest.raises(ConfigError, match=r"data\.path.*data\.source=digits.*data\.source=auto"):
        build_config(overrides=["data.path=pets"])
    assert build_config(overrides=["data.path=pets", "data.source=auto"]).data.path == "pets"


def test_yaml_roundtrip_and_checkpoint_base():
    cfg = build_config("cifar10-vit-tiny", overrides=["data.path=/data/c.tar"])
    again = build_config(base=cfg.to_dict())
    assert again == cfg
    assert "vit_cifar_patch4_32" in to_yaml(cfg)


def test_parse_helpers():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_duration("15m") == 900 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_renamed_keys_are_read_under_their_new_names(caplog):
    """The model section's keys are create_model's argument names; the old names still work (old
    command lines with a warning, old checkpoints' configs silently)."""
    with caplog.at_level("WARNING", logger="vitflow.config"):
        cfg = build_config(overrides=["model.image_size=16", "model.layer_scale=1e-5"])
    assert (cfg.model.img_size, cfg.model.layer_scale_init) == (16, 1e-5)
    assert "model.image_size (in command line) is now called model.img_size" in caplog.text
    old = build_config().to_dict()
    old["model"]["image_size"] = old["model"].pop("img_size")
    old["model"]["distill_token"] = old["model"].pop("distilled")
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitflow.config"):
        assert build_config(base=old) == build_config()
    assert caplog.text == ""


def test_layer_checks_run_only_when_given():
    """The config itself knows no model names or split syntax (it imports no layer): those checks
    are the layers', passed in."""
    cfg = build_config(overrides=["model.name=not_a_model", "data.train_split=train[:98"])
    assert cfg.model.name == "not_a_model"
    with pytest.raises(ConfigError, match=r"data\.train_split.*\(in command line\)"):
        build_config(overrides=["data.train_split=train[:98"], checks=CONFIG_CHECKS)
