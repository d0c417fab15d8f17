"""Fine-tuning modes (training/optim/finetune.py) on the embedded digits with the tiny ViT: linear probe,
partial freezing, LP-FT (the switch, its schedule, exact resume across it) and LoRA (only the
adapters and the head train; the checkpoint evaluates, exports and quantises as a plain model)."""

import logging
import shutil

import pytest
import torch

from helpers import comparable_records, digits_config
from vitflow import checkpoint as ckpt
from vitflow import create_model
from vitflow.config import ConfigError, build_config
from vitflow.models.lora import LoRALinear
from vitflow.rundir import read_metrics
from vitflow.training import Trainer

FAST = ("train.total_steps=6", "train.batch_size=16", "optim.warmup_steps=0", "train.log_every=1",
        "train.precision=fp32", "data.test_split=train[90%:]")
HEAD = {"head.weight", "head.bias"}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict, after: dict) -> set[str]:
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


def _numel(model: torch.nn.Module, names) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


def test_linear_probe_changes_only_the_head(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="vitflow.training.optim.finetune"):
        tr = Trainer(digits_config(tmp_path / "run", *FAST, "finetune.mode=linear_probe"))
    before = _weights(tr.model)
    r = tr.fit()
    assert _changed(before, _weights(tr.model)) == HEAD  # every other tensor bit-identical
    total = sum(p.numel() for p in tr.model.parameters())
    assert r["finetune"] == "linear_probe" and r["trainable_params"] == _numel(tr.model, HEAD) == 650
    assert r["total_params"] == total
    state = ckpt.load_checkpoint(r["checkpoint"])
    assert len(state["optimizer"]["state"]) == 2  # no optimizer state for the frozen tensors
    assert (f"fine-tuning: mode linear_probe; the backbone (all but the head) frozen; 650 of {total:,} parameters "
            f"train ({650 / total:.2%})") in caplog.text


def test_partial_freezing_freezes_the_patch_embedding_and_the_first_blocks(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="vitflow.training.optim.finetune"):
        tr = Trainer(digits_config(tmp_path / "run", *FAST, "finetune.freeze_patch_embed=true",
                                   "finetune.freeze_blocks=2"))
    before = _weights(tr.model)
    r = tr.fit()
    frozen = {k for k in before if k.startswith(("patch_embed.", "pos_embed", "blocks.0.", "blocks.1."))}
    assert len(frozen) == 3 + 2 * 12
    assert _changed(before, _weights(tr.model)) == set(before) - frozen
    assert r["finetune"] == "full" and r["trainable_params"] == _numel(tr.model, set(before) - frozen)
    assert "mode full; the patch embedding, position embedding and tokens; blocks 0-1 frozen" in caplog.text
    with pytest.raises(ValueError, match="finetune.freeze_blocks=5 is invalid: the model has 4 blocks"):
        Trainer(digits_config(tmp_path / "run2", *FAST, "finetune.freeze_blocks=5"))


LPFT = (*FAST, "finetune.mode=lp_ft", "finetune.probe_steps=3", "optim.warmup_steps=2", "model.drop_path_rate=0.1",
        "train.checkpoint_every=1", "train.keep_checkpoints=100")


def test_lp_ft_switches_at_its_step_restarts_the_schedule_and_resumes_exactly_across_the_switch(tmp_path, caplog):
    full = tmp_path / "full"
    with caplog.at_level(logging.INFO, logger="vitflow.training.optim.finetune"):
        tr = Trainer(digits_config(full, *LPFT))
        initial = _weights(tr.model)
        r = tr.fit()
    assert "LP-FT switch at step 3: backbone unfrozen" in caplog.text and r["probe_end_step"] == 3
    backbone = set(initial) - HEAD
    at = {s: ckpt.load_checkpoint(ckpt.checkpoint_path(full, s)) for s in (1, 3, 4)}
    assert _changed(initial, at[1]["model"]) == HEAD
    assert _changed(initial, at[3]["model"]) == HEAD  # three probe steps: the backbone untouched
    assert _changed(initial, at[4]["model"]) >= backbone  # the first step after the switch moves it
    assert len(at[3]["optimizer"]["state"]) == 2 and len(at[4]["optimizer"]["state"]) == len(initial)
    lr = {rec["step"]: rec["lr"] for rec in read_metrics(full) if rec["kind"] == "train"}
    peak = tr.cfg.optim.lr  # warmup 2: steps 0, 1 at 1/2, 2/2; the restart at 3: 1/2 again
    assert lr[1] == pytest.approx(peak) and lr[3] == pytest.approx(peak / 2) and lr[4] == pytest.approx(peak)
    final = ckpt.load_checkpoint(ckpt.checkpoint_path(full, 6))
    for k in (2, 4):  # killed before and after the switch, resumed from the checkpoint of step k
        run = tmp_path / f"resumed{k}"
        shutil.copytree(full, run)
        for p in ckpt.list_checkpoints(run)[k:]:
            p.unlink()
        Trainer(build_config(base=digits_config(run, *LPFT).to_dict(), overrides=["train.resume=auto"])).fit()
        again = ckpt.load_checkpoint(ckpt.checkpoint_path(run, 6))
        assert not _changed(final["model"], again["model"]), k
        moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in final["optimizer"]["state"].values()]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(moments, [(s["exp_avg"], 0) for s in
                                                                         again["optimizer"]["state"].values()]))
        assert comparable_records(run) == comparable_records(full)


def test_lora_trains_only_adapters_and_head_and_its_checkpoint_serves_a_plain_model(tmp_path, caplog):
    torch.manual_seed(123)
    pretrained = create_model("vit_digits_patch2_8", num_classes=10)
    torch.save(pretrained.state_dict(), tmp_path / "pretrained.pt")
    targets = "finetune.lora_targets=attn.qkv,attn.proj,mlp.fc1,mlp.fc2"
    with caplog.at_level(logging.INFO, logger="vitflow.training.optim.finetune"):
        tr = Trainer(digits_config(tmp_path / "run", *FAST, "finetune.mode=lora", "finetune.lora_rank=4", targets,
                                   f"model.pretrained={tmp_path / 'pretrained.pt'}"))
    assert "LoRA: rank 4, alpha 16 (scale 4), dropout 0 on 16 linear layers" in caplog.text
    before = _weights(tr.model)
    assert all(torch.equal(before[k], v) for k, v in pretrained.state_dict().items())  # base weights = the file's
    r = tr.fit()
    adapters = {k for k in before if k.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 16 and _changed(before, _weights(tr.model)) == adapters | HEAD
    assert r["finetune"] == "lora" and r["trainable_params"] == _numel(tr.model, adapters | HEAD) == 4 * 4 * (
        (64 + 192) + (64 + 64) + (64 + 128) + (128 + 64)) + 650
    state = ckpt.load_checkpoint(r["checkpoint"])
    assert state["model_args"]["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.0,
                                           "targets": ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]}
    assert adapters <= set(state["model"])  # the training checkpoint keeps the adapters unmerged
    served = ckpt.model_from_checkpoint(state)
    assert not any(isinstance(m, LoRALinear) for m in served.modules())
    assert set(served.state_dict()) == set(pretrained.state_dict())  # a plain ViT
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        expected = tr.model.eval()(x)
        torch.testing.assert_close(served(x), expected, atol=1e-5, rtol=1e-5)
    from vitflow.infer.evaluate import evaluate_checkpoint
    from vitflow.infer.export.formats import export_onnx
    from vitflow.infer.runtimes.onnx import ModelInfo, OnnxModel

    assert evaluate_checkpoint(r["checkpoint"])["test_top1"] == pytest.approx(r["test_top1"], abs=1e-9)
    info = ModelInfo.from_checkpoint(state)
    assert "lora" not in info.model_args  # the exported model is a plain one
    export_onnx(served, tmp_path / "model.onnx", info)  # as `vitflow export` does
    torch.testing.assert_close(OnnxModel(tmp_path / "model.onnx")(x), expected, atol=1e-4, rtol=1e-4)

    # the LoRA checkpoint as model.pretrained: adapters merged on load (models/pretrained/weights.py read_state_dict)
    merged = served.state_dict()
    assert not torch.allclose(merged["blocks.0.attn.qkv.weight"], pretrained.state_dict()["blocks.0.attn.qkv.weight"])
    loaded = create_model("vit_digits_patch2_8", pretrained=r["checkpoint"], num_classes=10).eval()
    assert set(loaded.state_dict()) == set(merged)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)
    again = Trainer(digits_config(tmp_path / "run2", *FAST, f"model.pretrained={r['checkpoint']}"))
    assert all(torch.allclose(again.model.state_dict()[k], v, atol=1e-6) for k, v in merged.items())


def test_lora_checkpoint_quantises_to_a_plain_int8_model(tmp_path):
    from vitflow.infer.quantize.dynamic import quantize_file

    r = Trainer(digits_config(tmp_path / "run", *FAST, "train.total_steps=2", "finetune.mode=lora")).fit()
    quantize_file(r["checkpoint"], tmp_path / "int8.pt", backend="torch", log=lambda s: None)
    state = ckpt.load_checkpoint(tmp_path / "int8.pt")
    assert state["quantization"] == "dynamic-int8" and not any("lora" in k for k in state["model"])
    q, ref = ckpt.model_from_checkpoint(state), ckpt.model_from_checkpoint(ckpt.load_checkpoint(r["checkpoint"]))
    x = torch.randn(8, 3, 8, 8)
    with torch.no_grad():
        assert (q(x) - ref(x)).abs().max() < 0.05  # INT8 weights of the merged model


def test_finetune_keys_are_checked():
    with pytest.raises(ConfigError, match="finetune.mode='lora' is invalid: must be full or lp_ft with "
                                          "finetune.freeze_patch_embed / finetune.freeze_blocks"):
        build_config(overrides=["finetune.mode=lora", "finetune.freeze_blocks=1"])
    with pytest.raises(ConfigError, match="finetune.probe_steps=100.0 is invalid: must be below "
                                          "train.total_steps=100"):
        build_config(overrides=["finetune.mode=lp_ft", "finetune.probe_steps=100", "train.total_steps=100"])
    with pytest.raises(ConfigError, match="finetune.probe_steps=2.5 is invalid"):
        build_config(overrides=["finetune.probe_steps=2.5"])
    with pytest.raises(ConfigError, match="finetune.lora_rank=0 is invalid"):
        build_config(overrides=["finetune.lora_rank=0"])
    assert build_config(overrides=["finetune.mode=lp_ft", "train.total_steps=10"]).finetune.probe_end(10) == 2


def test_finetune_preset_runs_lp_ft_on_a_photo_folder_from_pretrained_weights(tmp_path, capsys):
    from helpers import make_folder
    from vitflow.cli import main

    data = make_folder(tmp_path / "photos", per_class=6, size=16, split="train")
    make_folder(tmp_path / "photos", per_class=2, size=16, split="val", seed=1)
    torch.save(create_model("vit_digits_patch2_8", num_classes=5).state_dict(), tmp_path / "w.pt")
    run = tmp_path / "run"
    assert main(["train", "-q", "--preset", "finetune", f"data.path={data}", f"model.pretrained={tmp_path / 'w.pt'}",
                 "model.name=vit_digits_patch2_8", "model.img_size=8", "train.batch_size=6", "train.total_steps=4",
                 "optim.warmup_steps=1", "finetune.mode=lp_ft", f"train.run_dir={run}"]) == 0
    summary = [r for r in read_metrics(run) if r["kind"] == "summary"][-1]
    assert summary["finetune"] == "lp_ft" and summary["probe_end_step"] == 1 and "val_top1" in summary
    state = ckpt.load_checkpoint(run)
    assert state["config"]["optim"]["layer_decay"] == 0.75 and state["model_args"]["num_classes"] == 3


def test_schedule_restart_runs_the_schedule_over_the_probe_then_again_to_the_end(tmp_path, capsys):
    from vitflow.cli import main
    from vitflow.training.optim.schedules import Schedule

    f = Schedule(20, warmup_steps=3, kind="cosine", min_ratio=0.1, restart=8)
    probe, rest = Schedule(8, 3, "cosine", 0.1), Schedule(12, 3, "cosine", 0.1)
    assert [f(s) for s in range(8)] == [probe(s) for s in range(8)]
    assert [f(s) for s in range(8, 25)] == [rest(s) for s in range(17)]
    assert f(8) == pytest.approx(1 / 3) and f(7) < 0.3 and f(24) == pytest.approx(0.1)
    f.total_steps = 30  # a time budget / a resumed run stretching the length: only the second run changes
    assert f(5) == probe(5) and f(30) == pytest.approx(0.1) and f(19) > 0.2
    # the preset's model.name=auto needs weights; the schedule does not depend on the model
    assert main(["lr-schedule", "--preset", "finetune", "finetune.mode=lp_ft", "model.name=vit_digits_patch2_8",
                 "-o", str(tmp_path / "lr.png")]) == 0
    out = capsys.readouterr().out
    assert "step     125  lr 8.000e-06" in out  # the warmup again, from the switch and (tmp_path / "lr.png").stat().st_size > 1000
