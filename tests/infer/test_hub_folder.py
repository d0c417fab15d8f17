"""vitflow export --format hub: a timm-layout folder (config.json, model.safetensors, README.md) that
timm 1.0.31 (`local-dir:`) and vitflow load with the same logits."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import snapshot
from vitflow.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
from vitflow.cli import main
from vitflow.data import decode_image, model_input
from vitflow.data.transforms import Preprocess, eval_transform
from vitflow.infer.export.hub_folder import read_hub_folder, save_hub_folder
from vitflow.models import create_model
from vitflow.models.lora import DEFAULT_TARGETS, apply_lora, lora_args
from vitflow.models.pretrained.config import create_pretrained_model

timm = pytest.importorskip("timm")


def timm_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    with torch.no_grad():
        return model(x)


def test_export_hub_loads_in_timm_and_vitflow(tiny_run, tmp_path, capsys):
    run, summary = tiny_run
    out = tmp_path / "digits-vit"
    assert main(["export", str(run), "--format", "hub", "-o", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip())
    assert r["files"] == ["README.md", "config.json", "model.safetensors"] and r["max_abs_diff"] == 0.0
    state = load_checkpoint(run)
    pp = Preprocess.from_dict(state["preprocess"])
    images = [decode_image(p.read_bytes(), str(p)) for p in sorted(Path(summary["samples"]).glob("*.png"))]
    x = model_input(torch.stack([eval_transform(pp)(im) for im in images]), pp.mean, pp.std, torch.device("cpu"))
    with torch.no_grad():
        want = model_from_checkpoint(state)(x)
    assert (timm_logits(out, x) - want).abs().max() <= 1e-5
    hub = read_hub_folder(out)
    with torch.no_grad():
        assert torch.equal(hub.model(x), want)
    assert hub.preprocess == pp and hub.classes == state["classes"] and hub.name == "vit_digits_patch2_8"

    config = json.loads((out / "config.json").read_text())
    assert config["pretrained_cfg"]["input_size"] == [3, pp.image_size, pp.image_size]
    assert (config["pretrained_cfg"]["mean"], config["pretrained_cfg"]["std"]) == (list(pp.mean), list(pp.std))
    assert (config["pretrained_cfg"]["crop_pct"], config["pretrained_cfg"]["interpolation"]) == (pp.crop_pct, "bicubic")
    assert config["label_names"] == state["classes"] and config["num_features"] == 64
    card = (out / "README.md").read_text()
    assert f"{summary['test_top1']:.2%}" in card and "local-dir:digits-vit" in card and "center-crop 8 x 8" in card

    # vitflow predict reads the folder: the same probabilities as from the run
    samples = [str(p) for p in sorted(Path(summary["samples"]).glob("*.png"))]
    rows = []
    for model_path in (out, run):
        assert main(["predict", str(model_path), *samples, "--json"]) == 0
        rows.append([json.loads(line) for line in capsys.readouterr().out.strip().splitlines()])
    assert rows[0] == rows[1] and len(rows[0]) == 10

    # a timm folder (no `vitflow` key) is read from its architecture and model_args, head and classes too
    timm_only = tmp_path / "timm-only"
    timm_only.mkdir()
    (timm_only / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (timm_only / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "vitflow"}))
    plain = read_hub_folder(timm_only)
    with torch.no_grad():
        assert (plain.model(x) - want).abs().max() <= 1e-6 and plain.classes == state["classes"]

    before = snapshot(out)  # a folder that is not empty is never written into
    assert main(["export", str(run), "--format", "hub", "-o", str(out)]) == 2
    assert "never overwritten" in capsys.readouterr().err and snapshot(out) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert save_hub_folder(run, empty)["max_abs_diff"] == 0.0  # an empty folder is fine
    assert not list(tmp_path.glob(".*.partial"))


def fake_checkpoint(tmp_path: Path, name: str, lora: dict | None = None, **model_args) -> Path:
    """A checkpoint written directly (no training): ``name`` with 2 blocks, 3 classes, random
    weights (every tensor moved off its initial value: a near-zero head or LayerScale would hide
    a mix-up); with ``lora`` (``rank``, ``alpha``), unmerged adapters with non-zero ``B`` as a
    LoRA run saves them (``model_args["lora"]``)."""
    torch.manual_seed(0)
    args = {"name": name, "num_classes": 3, "img_size": 32, "depth": 2, **model_args}  # 2 blocks: fast
    kw = {k: v for k, v in args.items() if k != "name"}
    model = create_model(name, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if lora:
        apply_lora(model, **lora)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("lora_B"):
                    p.normal_(0, 0.1)  # B starts at zero: trained adapters change the function
        args["lora"] = lora_args(lora["rank"], lora["alpha"], 0.0, DEFAULT_TARGETS)
    pp = Preprocess(args["img_size"], 0.9, "bilinear", (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    return save_checkpoint({"step": 7, "model": model.state_dict(), "model_args": args, "classes": ["x", "y", "z"],
                            "preprocess": pp.to_dict(), "config": {}, "metrics": {"top1": 0.5, "loss": 1.0}},
                           tmp_path / "ckpt.pt")


@pytest.mark.parametrize("name,extra", [("vit_tiny_patch16_224", {}), ("deit_tiny_distilled_patch16_224", {}),
                                        ("vit_tiny_patch16_224", {"layer_scale_init": 0.1, "global_pool": "avg"})])
def test_timm_named_variants(tmp_path, name, extra):
    """Class token, class + distillation tokens, and LayerScale with average pooling."""
    ckpt = fake_checkpoint(tmp_path, name, **extra)
    r = save_hub_folder(ckpt, tmp_path / "hub")
    assert r["architecture"] == name  # timm knows the name
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model_from_checkpoint(load_checkpoint(ckpt))(x)
    assert (timm_logits(tmp_path / "hub", x) - want).abs().max() <= 1e-5
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    cfg = config["pretrained_cfg"]
    assert (cfg["crop_pct"], cfg["interpolation"], cfg["mean"]) == (0.9, "bilinear", [0.5, 0.4, 0.3])
    del config["vitflow"]  # as timm would have written it: vitflow reads architecture + model_args
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert (read_hub_folder(tmp_path / "hub").model(x) - want).abs().max() <= 1e-6


def test_a_swin_timm_has_no_name_for_is_its_tiny_swin_with_explicit_sizes(tmp_path):
    """vitflow's 32x32 Swin (patch 2, window 4, three stages, MLP ratio 2): config.json names timm's
    swin_tiny_patch4_window7_224 with the sizes that differ, and timm's model built from it gives
    the checkpoint's logits; vitflow reads the folder back, also without its own ``vitflow`` key."""
    ckpt = fake_checkpoint(tmp_path, "swin_cifar_patch2_window4_32", depth=None)
    r = save_hub_folder(ckpt, tmp_path / "hub")
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert r["architecture"] == config["architecture"] == "swin_tiny_patch4_window7_224"
    assert config["model_args"] == {"img_size": 32, "num_classes": 3, "patch_size": 2, "window_size": 4,
                                    "depths": [2, 2, 2], "num_heads": [3, 6, 12], "mlp_ratio": 2.0}
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model_from_checkpoint(load_checkpoint(ckpt))(x)
    assert (timm_logits(tmp_path / "hub", x) - want).abs().max() <= 1e-5
    del config["vitflow"]
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert (read_hub_folder(tmp_path / "hub").model(x) - want).abs().max() <= 1e-6


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_sincos_positions_are_written_as_timms_learned_table(tmp_path, pool):
    """Fixed 2-D sin-cos positions (the planned photo model's) with average pooling (no class token)
    or a class token (its zero row): timm loads the table as its learned pos_embed, same logits."""
    ckpt = fake_checkpoint(tmp_path, "vit_tiny_patch16_224", pos_embed="sincos2d", global_pool=pool)
    r = save_hub_folder(ckpt, tmp_path / "hub")
    assert r["max_abs_diff"] == 0.0
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model_from_checkpoint(load_checkpoint(ckpt))(x)
    assert (timm_logits(tmp_path / "hub", x) - want).abs().max() <= 1e-5
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert config["vitflow"]["model_args"]["pos_embed"] == "sincos2d" and "pos_embed" not in config["model_args"]
    assert "sin-cos positions" in (tmp_path / "hub" / "README.md").read_text()


def test_models_timm_cannot_rebuild_are_refused(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path, "vit_tiny_patch16_224", pos_embed="relative")
    assert main(["export", str(ckpt), "--format", "hub", "-o", str(tmp_path / "hub")]) == 2
    err = capsys.readouterr().err
    assert "model.pos_embed='relative': timm's VisionTransformer has no relative position bias" in err
    assert not (tmp_path / "hub").exists()


def random_pngs(folder: Path, size: int, count: int = 3) -> list[str]:
    from helpers import encode

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        (folder / f"{i}.png").write_bytes(encode(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)))
    return [str(p) for p in sorted(folder.glob("*.png"))]


@pytest.mark.parametrize("name,lora", [("vit_small_patch14_reg4_dinov2", None),
                                       ("eva02_tiny_patch14_224", {"rank": 2, "alpha": 4.0})])
def test_pretrained_families(tmp_path, capsys, name, lora):
    """A DINOv2-reg4 model and a LoRA-trained EVA-02 (adapters merged on export), 2 blocks at 28 px:
    timm builds its same-name model with ``depth`` / ``img_size`` / ``num_classes`` from
    ``model_args`` and gives the checkpoint's logits; vitflow reads the folder back as
    ``model.pretrained`` (architecture and sizes from config.json) and through ``vitflow predict``."""
    ckpt = fake_checkpoint(tmp_path, name, lora=lora, img_size=28)
    out = tmp_path / "hub"
    r = save_hub_folder(ckpt, out)
    assert r["architecture"] == name and r["max_abs_diff"] == 0.0
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"] == {"img_size": 28, "num_classes": 3, "depth": 2}
    assert "lora" not in config["vitflow"]["model_args"]
    x = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model_from_checkpoint(load_checkpoint(ckpt))(x)
    assert (timm_logits(out, x) - want).abs().max() <= 1e-5
    if lora:  # the merged adapters are in the folder: the base weights alone give other logits
        base = create_model(name, num_classes=3, img_size=28, depth=2)
        saved = load_checkpoint(ckpt)["model"]
        base.load_state_dict({k: v for k, v in saved.items() if "lora_" not in k})
        with torch.no_grad():
            assert (base.eval()(x) - want).abs().max() > 0.1
        as_pretrained = create_model(name, pretrained=str(ckpt), num_classes=3, img_size=28, depth=2).eval()
        with torch.no_grad():  # the LoRA checkpoint itself as model.pretrained: merged on load (models.weights)
            assert (as_pretrained(x) - want).abs().max() <= 1e-5

    model, pre = create_pretrained_model(str(out))  # model.pretrained=DIR: models.hub + weights
    assert pre.model_kwargs["depth"] == 2 and pre.preprocess["input_size"] == 28 and pre.label_names == ["x", "y", "z"]
    with torch.no_grad():
        assert (model.eval()(x) - want).abs().max() <= 1e-6

    samples = random_pngs(tmp_path / "images", 28)
    rows = []
    for model_path in (out, ckpt):
        assert main(["predict", str(model_path), *samples, "--json"]) == 0
        rows.append([json.loads(line) for line in capsys.readouterr().out.strip().splitlines()])
    assert rows[0] == rows[1] and len(rows[0]) == 3

    del config["vitflow"]  # as timm would have written it: vitflow reads architecture + model_args (depth)
    (out / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        assert (read_hub_folder(out).model(x) - want).abs().max() <= 1e-6


def test_pretrained_family_options_timm_lacks_are_refused(tmp_path, capsys):
    ckpt = fake_checkpoint(tmp_path, "vit_small_patch14_dinov2", img_size=28, norm_eps=1e-3)
    assert main(["export", str(ckpt), "--format", "hub", "-o", str(tmp_path / "hub")]) == 2
    assert "model.norm_eps=0.001" in capsys.readouterr().err and not (tmp_path / "hub").exists()
