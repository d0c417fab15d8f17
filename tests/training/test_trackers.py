"""MLflow and Weights & Biases behind the metrics log: a short digits run's parameters, step
metrics and files read back through each tracker's own client or files; an MLflow file store, a
real MLflow tracking server on 127.0.0.1, and a W&B offline run folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import yaml

from helpers import digits_config
from servers_mlflow import mlflow_server  # noqa: F401  (the fixture)
from vitflow.config.build import flatten
from vitflow.rundir import read_metrics
from vitflow.training.loop import Trainer
from vitflow.training.track.trackers import MLflowTracker, TrackerError, Trackers, check_trackers, mlflow_uri

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
RUN = ("train.total_steps=20", "train.eval_every=10", "train.log_every=5")


def _records(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What the trackers must hold: ``name -> [(step, value)]`` from the run's metrics.jsonl."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in read_metrics(run_dir):
        if r["kind"] in ("train", "eval"):
            prefix = "train" if r["kind"] == "train" else r["split"]
            for k, v in r.items():
                numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
                if numeric and k not in ("time", "kind", "step", "epoch"):
                    out.setdefault(f"{prefix}/{k}", []).append((r["step"], v))
    return out


def _check_mlflow(uri: str, run_dir: Path, tmp_path: Path, config_yaml: str | None = None) -> None:
    """The MLflow run of ``run_dir`` holds its config as parameters, every train/eval figure at its
    step, and its eval.json. A resumed run (``config_yaml``: of its first start) keeps the records
    its resume cut from the run directory too (the first end's final evaluation)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(json.loads((run_dir / "trackers.json").read_text())["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    cfg = flatten(yaml.safe_load(config_yaml or (run_dir / "config.yaml").read_text()))
    assert run.data.params == {k: str(tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()}
    expected = _records(run_dir)
    assert {"train/loss", "train/lr", "train/images_per_s", "test/top1", "test/loss"} <= set(expected)
    for name, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        if config_yaml is None:
            assert history == [(s, pytest.approx(v, rel=1e-9)) for s, v in points], name
        else:
            assert set(points) <= set(history), name
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"eval.json", "config.yaml"}
    local = client.download_artifacts(run.info.run_id, "eval.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == json.loads((run_dir / "eval.json").read_text())


def test_mlflow_file_store_and_wandb_offline_get_the_runs_params_metrics_and_files(tmp_path, monkeypatch,
                                                                                    mlflow_server):  # noqa: F811
    # (asking for mlflow_server starts the server now, while this test runs; the last test uses it)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "run"
    cfg = digits_config(run_dir, *RUN, f"train.mlflow={tmp_path / 'mlruns'}", "train.wandb=auto")
    Trainer(cfg).fit()
    _check_mlflow(mlflow_uri(str(tmp_path / "mlruns")), run_dir, tmp_path / "dl")

    folders = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 1
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] in folders[0].name
    history, config = _read_wandb(next(folders[0].glob("run-*.wandb")))
    got: dict[str, list] = {}
    for row in history:
        for k, v in row.items():
            if not k.startswith("_"):
                got.setdefault(k, []).append((row["_step"], v))
    assert got == {k: [(s, pytest.approx(v, rel=1e-9)) for s, v in pts] for k, pts in _records(run_dir).items()}
    assert config["train.total_steps"] == 20 and config["model.name"] == cfg.model.name
    files = folders[0] / "files"
    assert json.loads((files / "eval.json").read_text()) == json.loads((run_dir / "eval.json").read_text())

    # a resumed run continues the same MLflow run (parameters: the first start's): its history goes on
    first = (run_dir / "config.yaml").read_text()
    Trainer(digits_config(run_dir, *RUN[1:], "train.total_steps=25", "train.resume=auto",
                          f"train.mlflow={tmp_path / 'mlruns'}")).fit()
    _check_mlflow(mlflow_uri(str(tmp_path / "mlruns")), run_dir, tmp_path / "dl2", first)
    assert _records(run_dir)["train/loss"][-1][0] == 25


def test_trackers_log_the_report_and_the_end_state(tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    (run_dir / "report").mkdir(parents=True)
    for name, text in (("eval.json", "{}"), ("report.html", "<html></html>"), ("report/loss.png", "png")):
        (run_dir / name).write_text(text)
    uri = mlflow_uri(str(tmp_path / "store"))
    tracker = MLflowTracker(uri, "exp", "run", tags={})
    trackers = Trackers([tracker], run_dir)
    trackers.record({"kind": "train", "step": 5, "loss": 1.5, "lr": 0.1, "epoch": 0, "time": 1.0, "ok": True})
    trackers.record({"kind": "eval", "step": 5, "split": "val", "top1": 0.25, "split_expr": "train[80%:]"})
    trackers.record({"kind": "interrupted", "step": 5})
    trackers.close()
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert run.data.metrics == {"train/loss": 1.5, "train/lr": 0.1, "val/top1": 0.25}
    assert {a.path for a in client.list_artifacts(tracker.run_id)} == {"eval.json", "report.html", "report"}
    assert [a.path for a in client.list_artifacts(tracker.run_id, "report")] == ["report/loss.png"]
    assert json.loads((run_dir / "trackers.json").read_text()) == {"mlflow": tracker.run_id}


def test_mlflow_uri_and_a_missing_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert mlflow_uri("true") == (tmp_path / "mlruns").resolve().as_uri()
    assert mlflow_uri("file:runs/x") == mlflow_uri("runs/x") == (tmp_path / "runs" / "x").resolve().as_uri()
    assert mlflow_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert mlflow_uri("sqlite:///mlflow.db") == "sqlite:///mlflow.db"
    assert mlflow_uri(None) is None and mlflow_uri("False") is None
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = digits_config(tmp_path / "never", "train.wandb=offline")
    with pytest.raises(TrackerError, match=r"train.wandb is set but the wandb package is not installed: "
                                           r"pip install 'vitflow\[wandb\]'"):
        check_trackers(cfg.train)
    with pytest.raises(TrackerError):
        Trainer(cfg)
    assert not (tmp_path / "never").exists()


def test_a_run_logs_over_http_to_a_real_mlflow_tracking_server(tmp_path, mlflow_server):  # noqa: F811
    run_dir = tmp_path / "run"
    Trainer(digits_config(run_dir, *RUN, f"train.mlflow={mlflow_server.url}", "train.mlflow_experiment=served")).fit()
    _check_mlflow(mlflow_server.url, run_dir, tmp_path / "dl")
    assert not (run_dir / "mlruns").exists() and list((mlflow_server.root / "artifacts").rglob("eval.json"))


def _read_wandb(path: Path) -> tuple[list[dict], dict]:
    """The history rows and the config of a W&B ``.wandb`` file (LevelDB log format: a 7-byte
    W&B header, then 32 KiB blocks of records, each ``crc32 u32, length u16, type u8``; type 1 a
    whole record, 2/3/4 its first/middle/last piece), parsed with wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pieces, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pieces)
            records.append(rec)
    history, config = [], {}
    for rec in records:
        which = rec.WhichOneof("record_type")
        if which == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif which == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update if i.key != "_wandb"})
    return history, config
