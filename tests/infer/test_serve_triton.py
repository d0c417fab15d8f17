"""``vitflow export --format triton``: a Triton model repository, checked by reading the config
back with protobuf's text-format parser (no Triton server runs here) and running its ONNX model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import make_folder
from vitflow.checkpoint import load_checkpoint, model_from_checkpoint
from vitflow.cli import main
from vitflow.data import model_input
from vitflow.data.transforms import Preprocess
from vitflow.infer.runtimes.onnx import OnnxModel
from vitflow.infer.serve.triton import read_config


def test_triton_repository_reads_back_and_runs_as_the_checkpoint(tiny_run, tmp_path, capsys):
    run, _ = tiny_run
    folder = make_folder(tmp_path / "imgs", classes=("a",), per_class=4)
    repo = tmp_path / "repo"
    assert main(["export", str(run), "--format", "triton", "-o", str(repo), "--max-batch", "8", "--max-wait-ms",
                 "2.5", "--verify-data", str(folder), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["model"] == "run" and r["ok"]
    cfg = read_config(repo / "run" / "config.pbtxt")
    state = load_checkpoint(run)
    size = state["preprocess"]["image_size"]
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == ("run", "onnxruntime", 8)
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2, 4, 8]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 2500
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("pixel_values", 11, [3, size, size])]
    assert [(o.name, list(o.dims), o.label_filename) for o in cfg.output] == [("logits", [10], "labels.txt")]
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, 2)]  # KIND_CPU
    pp = Preprocess.from_dict(json.loads(cfg.parameters["vitflow.preprocess"].string_value))
    assert pp.to_dict() == state["preprocess"]
    labels = (repo / "run" / "labels.txt").read_text().splitlines()
    assert labels == list(state["classes"])
    x = model_input(torch.randint(0, 256, (3, 3, size, size), dtype=torch.uint8), pp.mean, pp.std)
    with torch.no_grad():
        want = model_from_checkpoint(state).eval()(x)
    got = OnnxModel(repo / "run" / "1" / "model.onnx")(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4)
    assert main(["export", str(run), "--format", "triton", "-o", str(repo)]) == 2  # nothing is overwritten
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_a_config_with_a_field_triton_does_not_have_is_refused(tmp_path):
    bad = tmp_path / "config.pbtxt"
    bad.write_text('name: "m"\nmax_batch_size: 4\ndynamic_batching { max_queue_delay_ms: 100 }\n')
    with pytest.raises(ValueError, match="not a valid Triton model config.*max_queue_delay_ms"):
        read_config(bad)
    bad.write_text('name: "m"\nmax_batch_size: "four"\n')
    with pytest.raises(ValueError, match="not a valid Triton model config"):
        read_config(bad)
