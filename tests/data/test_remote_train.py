"""Training from remote storage: a tar read in place over HTTP whose server dies mid-epoch stops the
run with a checkpoint and one line; once the server is back, ``vitflow resume`` finishes with the
weights of an uninterrupted run. A packed dataset on S3 trains as the local one does."""

from __future__ import annotations

import pytest
import torch

from helpers import make_folder, tar_folder
from servers import s3_upload
from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.config import build_config
from vitflow.data.prepare import prepare
from vitflow.training import Trainer

STEPS = 16


def _train(capsys, run, url, *extra, quiet: bool = True) -> tuple[int, str]:
    """``vitflow train`` (or ``extra``) in this process: ``(exit code, stderr)``."""
    code = main(["-q"] * quiet + [*(extra or ("train", f"data.path={url}", "data.train_split=train[:75%]",
                 "data.test_split=train[75%:]", "data.num_workers=0", "data.max_in_memory=0", "data.hflip=true",
                 "model.img_size=8", "model.drop_rate=0.1", "train.batch_size=8", f"train.total_steps={STEPS}",
                 f"train.run_dir={run}", "train.precision=fp32", "train.threads=1", "train.eval_every=0",
                 "data.remote_retries=2", "data.remote_backoff=0.05"))])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_http_server_dying_mid_epoch_stops_with_a_checkpoint_and_resume_finishes_bitwise(tmp_path, http_server,
                                                                                         capsys):
    store = tmp_path / "store"
    store.mkdir()
    tar_folder(make_folder(tmp_path / "imgs", per_class=16, size=12), store / "data.tar")
    base = http_server(store)
    url = f"{base}/data.tar"
    code, err = _train(capsys, tmp_path / "full", url)
    assert code == 0, err[-2000:]
    requests = base.server.requests
    base.server.die_after_requests(requests // 2)  # in the middle of the training reads
    run = tmp_path / "cut"
    code, err = _train(capsys, run, url, quiet=False)  # with the progress bar: closed before the error line
    last = err.strip().splitlines()[-1]
    assert code == 2, err[-2000:]
    assert last.startswith(f"error: {url}: read of bytes ") and " failed after 3 attempts: connection failed (" in last
    saved = ckpt.list_checkpoints(run)
    assert len(saved) == 1
    step = ckpt.load_checkpoint(saved[0])["step"]
    assert 0 < step < STEPS
    assert last.endswith(f"; the run stopped: checkpoint {saved[0]} written at step {step}; when the store is back, "
                         f"continue with: vitflow resume {run}")
    base.server.start()
    code, err = _train(capsys, run, url, "resume", str(run))
    assert code == 0, err[-2000:]
    a, b = (ckpt.load_checkpoint(ckpt.checkpoint_path(r, STEPS)) for r in (tmp_path / "full", run))
    assert a["data"]["position"] == b["data"]["position"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_training_from_a_packed_dataset_on_s3_equals_training_from_the_local_copy(tmp_path, s3_server):
    packed = tmp_path / "packed"
    prepare(make_folder(tmp_path / "imgs", per_class=8, size=8, split="train"), packed, fmt="raw")
    url = s3_upload(*s3_server, packed, "datasets")
    weights = []
    for path in (packed, url):
        cfg = build_config(overrides=[f"data.path={path}", "data.source=auto", "data.train_split=train[:75%]",
                                      "data.test_split=train[75%:]",
                                      "data.max_in_memory=0", "data.num_workers=0", "model.img_size=8",
                                      "train.batch_size=4", "train.total_steps=3", "train.eval_every=0",
                                      f"train.run_dir={tmp_path / ('run' + str(len(weights)))}",
                                      "train.precision=fp32", "train.threads=1"])
        r = Trainer(cfg).fit()
        weights.append(ckpt.load_checkpoint(r["checkpoint"])["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
