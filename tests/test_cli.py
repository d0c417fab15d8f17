import json
import logging
from pathlib import Path

import pytest

from helpers import make_folder
from vitflow.cli import main


def test_train_json_last_line(digits_run):
    run, r, proc = digits_run
    assert {"test_top1", "test_top5", "run_dir", "checkpoint"} <= set(r)
    assert 0.7 < r["test_top1"] <= r["test_top5"] <= 1.0  # 10 classes: chance is 0.1
    assert Path(r["checkpoint"]).is_file() and r["run_dir"] == str(run)
    assert len(proc.stdout.splitlines()) == 1  # --json: stdout is the JSON line alone (pipe it to jq)
    assert "test top-1" in proc.stderr and "run directory" in proc.stderr


def test_eval_matches_training_result(digits_run, capsys):
    run, r, _ = digits_run
    assert main(["eval", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.strip().splitlines()
    e = json.loads(line)
    assert f"test top-1 {e['test_top1']:.2%}" in captured.err
    assert e["test_top1"] == pytest.approx(r["test_top1"]) and e["test_images"] == 359  # 1797 - round(0.8 * 1797)


def test_eval_applies_kernel_overrides(digits_run, capsys, monkeypatch):
    """model.attention / model.cpu_bf16_matmul on `vitflow eval` choose the kernels (fixed kernels
    make bf16 repeats bit-identical); the weights and the result stay the checkpoint's."""
    from vitflow.models.vit.model import VisionTransformer

    run, r, _ = digits_run
    calls = []
    for name in ("set_attention_backend", "set_cpu_bf16_matmul"):
        original = getattr(VisionTransformer, name)
        monkeypatch.setattr(VisionTransformer, name,
                            lambda self, mode, _f=original, _n=name: calls.append((_n, mode)) or _f(self, mode))
    results = []
    for _ in range(2):
        assert main(["eval", str(run), "train.precision=bf16", "model.attention=sdpa", "model.cpu_bf16_matmul=fp32",
                     "--json"]) == 0  # the digits preset trains with math attention in fp32
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        results[-1].pop("images_per_s")  # measured, not a result
    overrides = [c for c in calls if c != ("set_cpu_bf16_matmul", "auto")]  # the constructor sets auto
    assert overrides == [("set_attention_backend", "sdpa"), ("set_cpu_bf16_matmul", "fp32")] * 2
    assert results[0] == results[1] and results[0]["test_top1"] == pytest.approx(r["test_top1"], abs=0.01)
    assert main(["eval", str(run), "model.attention=bogus"]) == 2


def test_predict_sample_images(digits_run, capsys):
    run, r, _ = digits_run
    samples = sorted(Path(r["samples"]).glob("*.png"))
    assert main(["predict", r["checkpoint"], *map(str, samples), "--topk", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(rows) == 10 and all(len(x["top"]) == 3 for x in rows)
    assert all(abs(sum(t["prob"] for t in x["top"]) - 1) < 0.5 for x in rows)
    right = sum(x["top"][0]["class"] == Path(x["path"]).stem.split("_")[1] for x in rows)
    assert right >= 6  # the file name carries the true digit


def test_predict_folder_with_a_bad_image(digits_run, tmp_path, capsys):
    run, r, _ = digits_run
    folder = tmp_path / "imgs"
    folder.mkdir()
    for p in sorted(Path(r["samples"]).glob("*.png"))[:3]:
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really")
    assert main(["predict", str(run), str(folder)]) == 0
    out = capsys.readouterr()
    assert out.out.count(".png:") == 3
    assert "broken.jpg" in out.err and "1 of 4" in out.err


def test_user_errors_exit_2_naming_the_problem(tmp_path, capsys):
    assert main(["train", "train.batch_sise=3"]) == 2
    assert "did you mean 'train.batch_size'" in capsys.readouterr().err
    assert main(["train", "--preset", "cifar10-vit-tiny", f"data.path={tmp_path / 'missing'}"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["train", "--preset", "cifar10-vit-tiny", "--print-config", f"data.path={tmp_path / 'missing'}"]) == 0
    out, err = capsys.readouterr()
    assert "path: " in out and err.strip() == f"warning: data.path {tmp_path / 'missing'} does not exist"
    assert main(["eval", str(tmp_path / "none.pt")]) == 2
    assert "none.pt" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "none.pt"), str(tmp_path)]) == 2
    capsys.readouterr()
    (tmp_path / "model.onnx").write_bytes(b"\x08\x09onnx-ish")
    assert main(["eval", str(tmp_path / "model.onnx")]) == 2
    err = capsys.readouterr().err
    assert "model.onnx carries no data path: evaluate it with data.path=PATH" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    assert main(["eval", str(tmp_path / "junk.pt")]) == 2
    err = capsys.readouterr().err
    assert "cannot read checkpoint" in err and "junk.pt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_own_folder_train_with_slices(tmp_path, capsys):
    data = make_folder(tmp_path / "pets", classes=("cat", "dog"), per_class=12, size=16)
    code = main(["train", "data.source=folder", f"data.path={data}", "data.train_split=train[:75%]",
                 "data.test_split=train[75%:]", "model.img_size=8", "train.total_steps=20", "train.batch_size=8",
                 f"train.run_dir={tmp_path / 'run'}", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["step"] == 20 and 0 <= r["test_top1"] <= 1
    samples = sorted((tmp_path / "run" / "samples").iterdir())  # held-out images, one per class first: the files
    assert r["samples"] == str(tmp_path / "run" / "samples") and sorted(
        p.name.split("_")[1] for p in samples) == ["cat.png"] * 3 + ["dog.png"] * 3  # the 6 held-out images
    cat = next(p for p in samples if p.name.endswith("_cat.png"))
    assert cat.read_bytes() in {p.read_bytes() for p in (data / "cat").iterdir()}


def test_presets_and_models_listing(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "cifar10-vit-b16-ft384" in out and "digits-vit-tiny" in out
    assert main(["presets", "cifar10-vit-tiny"]) == 0
    assert "vit_cifar_patch4_32" in capsys.readouterr().out
    assert main(["models", "vit_base_*"]) == 0
    assert "vit_base_patch16_224" in capsys.readouterr().out


@pytest.mark.parametrize("argv, level", [(["models"], logging.NOTSET), (["-v", "models"], logging.DEBUG),
                                         (["models", "-v"], logging.DEBUG), (["models", "--quiet"], logging.WARNING),
                                         (["-q", "models"], logging.WARNING)])
def test_verbosity_flags_set_vitflow_log_level_for_the_command(monkeypatch, argv, level):
    import vitflow.cli as cli
    from vitflow.runtime import quiet

    seen = []
    monkeypatch.setitem(cli.COMMANDS, "models",
                        lambda args: seen.append((logging.getLogger("vitflow").level, quiet())) or 0)
    assert main(argv) == 0
    assert seen == [(level, level == logging.WARNING)]  # default: inherits the root (INFO); -q: no progress bars
    assert logging.getLogger("vitflow").level == logging.NOTSET  # restored after the command
    with pytest.raises(SystemExit):
        main(["-q", "-v", "models"])  # one or the other


def test_small_user_errors_name_what_is_wrong(tmp_path, capsys):
    assert main(["models", "vit_nothing_*"]) == 2
    assert "no model matches 'vit_nothing_*'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["predict", "run", "img.png", "--topk", "0"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [  # one line, not the usage block
        "vitflow predict: error: argument --topk: must be >= 1 (got 0); see vitflow predict --help"]
    with pytest.raises(SystemExit) as e:
        main(["prune", "run.pt"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "vitflow prune: error: the following arguments are required: -o/--output; see vitflow prune --help"]
    assert main(["prepare", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: SRC {tmp_path / 'nope'} does not exist"
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'} does not exist"


def test_key_value_overrides_are_taken_after_flags(capsys):
    assert main(["train", "--print-config", "train.seed=3", "--json", "optim.lr=0.5"]) == 0
    out = capsys.readouterr().err  # with --json, every other line goes to stderr
    assert "seed: 3" in out and "lr: 0.5" in out
    with pytest.raises(SystemExit):
        main(["train", "--print-config", "--bogus"])
    assert capsys.readouterr().err.splitlines() == [  # the command's own help, not vitflow --help
        "vitflow train: error: unrecognized arguments: --bogus; see vitflow train --help"]


def test_presets_shows_the_finetune_preset_without_weights(capsys):
    """`vitflow presets finetune` prints the recipe (model.name=auto needs weights only to train)."""
    assert main(["presets", "finetune"]) == 0
    out = capsys.readouterr().out
    assert "name: auto" in out and "mode: full" in out
