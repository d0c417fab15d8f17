"""One table for the messages users meet most (vitflow.config.messages): the code prints them from it
and the troubleshooting page lists them from it. The common cases are triggered here for real, and
each printed line must come from an entry the rendered page shows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import make_folder, take_pretrained
from vitflow.cli import main
from vitflow.config import DataConfig, build_config
from vitflow.config.messages import MESSAGES, render
from vitflow.data.sources.dispatch import resolve_eval_splits
from vitflow.infer.export.hub_folder import timm_model_args
from vitflow.infer.quantize.dynamic import measured_split
from vitflow.models.pretrained.hub import resolve_pretrained
from vitflow.training.run.folder import check_new_run

DOCS = Path(__file__).resolve().parents[1] / "docs"


def rendered_page() -> str:
    spec = importlib.util.spec_from_file_location("vitflow_docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.on_page_markdown((DOCS / "troubleshooting.md").read_text(), None, None, None)


def entry_of(message: str) -> str:
    """The key of the table entry ``message`` was printed from (exactly one)."""
    keys = [k for k, m in MESSAGES.items() if m.pattern().match(message)]
    assert len(keys) == 1, message
    return keys[0]


def test_every_entry_is_on_the_troubleshooting_page_as_printed():
    page = rendered_page()
    assert "vitflow-messages" not in page  # every marker replaced
    for m in MESSAGES.values():
        assert f"### {m.title}\n" in page and f"{m.prefix}{m.format(**m.example)}\n" in page, m.key
        assert m.pattern().match(m.format(**m.example))
    assert {m.section for m in MESSAGES.values()} <= {s for s in ("Data", "Checkpoints and resume", "Deployment")
                                                      if render(s)}


def _raised(fn, *args, **kwargs) -> str:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return str(info.value.args[0])


def test_the_common_cases_print_their_entry(tmp_path: Path, monkeypatch):
    printed = {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    printed["hub_offline"] = _raised(resolve_pretrained, "hf-hub:someone/nothing-here")
    bare = tmp_path / "w.pt"
    torch.save({"blocks.0.norm1.weight": torch.ones(4)}, bare)
    printed["auto_without_architecture"] = _raised(take_pretrained, build_config(
        "finetune", overrides=[f"model.pretrained={bare}", "data.path=x"]))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    printed["run_without_checkpoint"] = _raised(resolve_pretrained, tmp_path / "run")
    only_train = make_folder(tmp_path / "only", split="train")
    printed["quantize_no_split"] = _raised(measured_split, str(only_train), None)
    classes = make_folder(tmp_path / "classes")
    printed["no_eval_split"] = _raised(resolve_eval_splits, DataConfig(path=str(classes)))
    (tmp_path / "run" / "run.json").write_text("{}")
    printed["run_dir_taken"] = _raised(check_new_run, tmp_path / "run", "none")
    printed["run_dir_not_empty"] = _raised(check_new_run, classes, "none")
    printed["hub_relative_positions"] = _raised(timm_model_args, {"name": "vit_tiny_patch16_224",
                                                                  "pos_embed": "relative"})
    from vitflow.models.pretrained import backbones

    monkeypatch.setattr(backbones, "_REACHABLE", {})
    printed["no_backbone"] = MESSAGES["no_backbone"].format(why=backbones.choose_backbone("cpu")[2], hub="timm/x")
    assert "HF_HUB_OFFLINE=1" in printed["no_backbone"]
    assert {k: entry_of(v) for k, v in printed.items()} == {k: k for k in printed}
    assert set(printed) == set(MESSAGES)  # every entry is a case met here
    # a split folder itself is measured whole, without --split
    assert measured_split(str(classes), None) == "train" and measured_split(str(only_train), "train[:50%]")


def test_the_cli_line_is_the_pages_line(tmp_path: Path, capsys):
    classes = make_folder(tmp_path / "pets")
    assert main(["train", f"data.path={classes}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and entry_of(err[len("error: "):]) == "no_eval_split"
