"""WebDataset shards served by real stores on 127.0.0.1 (tests/servers.py): the HTTP server and
moto's S3 server. Every rank x worker sees each of the folder's samples once per epoch, as from
local shards; training from HTTP / S3 shards gives the local run's weights bitwise; a server dying
mid-epoch stops the run with a checkpoint and one line, and ``vitflow resume`` finishes bitwise;
an unreachable or forbidden shard is named in one line."""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from pathlib import Path

import pytest
import torch

from helpers import make_folder
from servers import s3_upload
from vitflow import checkpoint as ckpt
from vitflow.cli import main
from vitflow.data import open_split
from vitflow.data.transforms import Preprocess, eval_transform, transform_encoded
from vitflow.data.wds.spool import PREFIX, spool_root
from vitflow.data.wds.stream import open_shard_stream, shard_loader
from vitflow.training.run.folder import write_samples

CLASSES = ("a", "b", "c", "d")
TRAIN = "train-{000000..000005}.tar"  # 40 samples, 7 a shard
VAL = "val-{000000..000001}.tar"  # 8 samples
STEPS = 10  # batch 8 from 40 samples: 5 batches an epoch, two epochs

pytestmark = pytest.mark.usefixtures("quick_retries")  # tests/servers.py: 2 retries, 10 ms apart


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder (train: 4 classes x 10, val: 4 x 2 images of 8 px) and its shards (7 samples a shard)."""
    root = tmp_path_factory.mktemp("wdsremote")
    make_folder(root / "folder", CLASSES, per_class=10, size=8, split="train")
    make_folder(root / "folder", CLASSES, per_class=2, size=8, split="val", seed=1)
    assert main(["-q", "prepare", str(root / "folder"), str(root / "shards"), "--format", "wds",
                 "--shard-size", "7"]) == 0
    return root / "folder", root / "shards"


@pytest.fixture
def stores(shards, http_server, s3_server):
    """``{kind: base URL of the shard folder}`` for local, HTTP and S3."""
    _, out = shards
    return {"local": str(out), "http": f"{http_server(out.parent)}/shards", "s3": s3_upload(*s3_server, out)}


def _epoch(pattern, rank, world, workers, epoch):
    """(digest, label) of every image rank ``rank`` trains on in ``epoch`` of the shards ``pattern``."""
    src = open_shard_stream(pattern, "train")
    transform = eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1)))
    loader, per_epoch = shard_loader(src, transform, 4, 0, 16, (epoch, 0), rank, world, workers, 2)
    got, it = [], iter(loader)
    for _ in range(per_epoch):
        b = next(it)
        assert not b["bad"]
        got += [(_digest(x), int(y)) for x, y in zip(b["images"], b["labels"])]
    return got


def test_http_and_s3_shards_give_each_rank_x_worker_the_folder_samples_once_per_epoch(shards, stores):
    folder, _ = shards
    src = open_split(folder, "train")
    transform = eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1)))
    expected = sorted((_digest(transform_encoded(transform, src.encoded(i), "")), int(src.labels[i]))
                      for i in range(len(src)))
    local = [_epoch(f"{stores['local']}/{TRAIN}", r, 2, 0, 1) for r in (0, 1)]
    for kind in ("http", "s3"):
        per_rank = [_epoch(f"{stores[kind]}/{TRAIN}", r, 2, 2, 1) for r in (0, 1)]  # 2 ranks x 2 workers
        assert [len(p) for p in per_rank] == [20, 20], kind
        assert sorted(s for p in per_rank for s in p) == expected, kind
        assert per_rank == local, kind  # the same order as from local shards


def test_val_split_from_http_shards_is_the_local_one_read_by_one_request_an_image(shards, http_server):
    _, out = shards
    base = http_server(out.parent)
    local, served = open_split(out, VAL), open_split(f"{base}/shards/{TRAIN}", VAL)
    assert len(local) == len(served) == 8 and served.classes == list(CLASSES)
    before = base.server.requests
    for i in range(len(local)):
        assert served.encoded(i) == local.encoded(i) and served.labels[i] == local.labels[i]
    assert base.server.requests - before == 2 + len(local)  # one size request a shard, then one GET an image


def _args(run, data) -> list[str]:
    """The overrides of a short training run from the shards ``data`` into ``run``."""
    return [f"data.path={data}", "data.num_workers=0", "data.shuffle_buffer=16", "data.hflip=true", "model.img_size=8",
            "model.drop_rate=0.1", "train.batch_size=8", f"train.total_steps={STEPS}", f"train.run_dir={run}",
            "train.precision=fp32", "train.threads=1", "train.eval_every=0", "train.eval_interval=null", f"data.val_split={VAL}",
            "data.remote_retries=2", "data.remote_backoff=0.05"]


def test_remote_shards_without_an_index_are_scanned_once_per_process(shards, http_server, tmp_path, caplog):
    import logging
    import shutil

    from vitflow.data.remote.fs import expand_urls
    from vitflow.data.wds.index import shard_set

    _, out = shards
    bare = shutil.copytree(out, tmp_path / "bare", ignore=shutil.ignore_patterns("shards.json"))
    base = http_server(tmp_path)
    urls = expand_urls(f"{base}/bare/{TRAIN}")
    with caplog.at_level(logging.INFO, "vitflow.data"):
        first = shard_set(urls)
        base.server.die_after_requests(0, matching="/train-")  # a second read of any shard would kill the server
        again = shard_set(urls)  # as a run's plan and then the run itself
    assert list(first.counts) == list(again.counts) == [7, 7, 7, 7, 7, 5] and again.classes == list(CLASSES)
    assert not base.server.dead
    assert sum("scanning 6 shard(s)" in r.getMessage() for r in caplog.records) == 1
    local = expand_urls(f"{bare}/{TRAIN}")
    assert list(shard_set(local).counts)[-1] == 5
    (bare / "train-000005.tar").write_bytes((bare / "train-000004.tar").read_bytes())  # local shards: counted anew
    assert list(shard_set(local).counts)[-1] == 7


def _train(capsys, run, data, *extra) -> tuple[int, str]:
    """``vitflow train`` from the shards ``data`` (or the command ``extra``) in this process:
    ``(exit code, stderr)``."""
    code = main(["-q", *(extra or ("train", *_args(run, data)))])
    return code, capsys.readouterr().err


def _weights(run) -> dict:
    return ckpt.load_checkpoint(ckpt.checkpoint_path(run, STEPS))


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["data"]["position"] == b["data"]["position"]
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


@pytest.mark.slow
def test_training_from_http_and_s3_shards_equals_training_from_local_shards_bitwise(stores, tmp_path, capsys):
    runs = {}
    for kind, base in stores.items():
        code, err = _train(capsys, tmp_path / kind, f"{base}/{TRAIN}")
        assert code == 0, err[-2000:]
        runs[kind] = _weights(tmp_path / kind)
    assert runs["local"]["data"]["position"] == [1, 5]  # the end of epoch 1
    _assert_bitwise(runs["local"], runs["http"])
    _assert_bitwise(runs["local"], runs["s3"])


def test_http_server_dying_mid_epoch_stops_with_a_checkpoint_and_resume_finishes_bitwise(shards, http_server,
                                                                                         tmp_path, capsys):
    _, out = shards
    base = http_server(out.parent)
    data = f"{base}/shards/{TRAIN}"
    code, err = _train(capsys, tmp_path / "full", data)
    assert code == 0, err[-2000:]
    # each shard read is a size request and a GET; the plan reads the first shard, epoch 0 the 6 shards:
    # die at the 12th shard read (the 11th is read, the 12th downloads ahead of it), in the middle of epoch 1
    base.server.die_after_requests(2 * 11, matching="/train-")
    run = tmp_path / "cut"
    code, err = _train(capsys, run, data)
    last = err.strip().splitlines()[-1]
    assert code == 2, err[-2000:]
    assert last.startswith(f"error: {base}/shards/train-0000") and " failed after 3 attempts: connection failed (" \
        in last, last
    saved = ckpt.list_checkpoints(run)
    assert len(saved) == 1
    state = ckpt.load_checkpoint(saved[0])
    assert 5 < state["step"] < STEPS and state["data"]["position"][0] == 1  # mid-epoch 1
    assert last.endswith(f"; the run stopped: checkpoint {saved[0]} written at step {state['step']}; when the "
                         f"store is back, continue with: vitflow resume {run}")
    base.server.start()
    code, err = _train(capsys, run, data, "resume", str(run))
    assert code == 0, err[-2000:]
    _assert_bitwise(_weights(tmp_path / "full"), _weights(run))


def _evals(run) -> list[tuple[int, float]]:
    """``(step, top-1)`` of the run's evaluation records, in order."""
    import json

    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["top1"]) for r in recs if r["kind"] == "eval"]


def test_a_store_lost_during_an_evaluation_is_evaluated_again_on_resume(shards, http_server, tmp_path, capsys):
    _, out = shards
    base = http_server(out.parent)
    data, every = f"{base}/shards/{TRAIN}", "train.eval_every=4 data.max_in_memory=0".split()
    code, err = _train(capsys, tmp_path / "full", data, "train", *_args(tmp_path / "full", data), *every)
    assert code == 0, err[-2000:]
    before = base.server.requests
    write_samples(open_split(data, VAL), tmp_path / "samples")  # as a run's start: open it, write held-out samples
    opening = base.server.requests - before  # the val split's requests before its first evaluation
    base.server.die_after_requests(opening + 3, matching="/val-")  # in the step-4 evaluation: its 2nd image read
    run = tmp_path / "cut"
    code, err = _train(capsys, run, data, "train", *_args(run, data), *every)
    assert code == 2 and f"error: {base}/shards/val-0000" in err.strip().splitlines()[-1], err[-2000:]
    (saved,) = ckpt.list_checkpoints(run)
    state = ckpt.load_checkpoint(saved)
    assert state["step"] == 4 and state["eval_due"]
    base.server.start()
    code, err = _train(capsys, run, data, "resume", str(run))
    assert code == 0, err[-2000:]
    full = _evals(tmp_path / "full")
    assert [s for s, _ in full] == [4, 8, 10] and _evals(run) == full  # the step-4 evaluation is not lost
    _assert_bitwise(_weights(tmp_path / "full"), _weights(run))


def test_forbidden_shard_and_unreachable_server_are_named_in_one_line(shards, http_server, tmp_path, capsys,
                                                                     caplog):
    _, out = shards
    base = http_server(out.parent)
    base.server.forbid("shards/train-000003.tar")
    code, err = _train(capsys, tmp_path / "forbidden", f"{base}/shards/{TRAIN}")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {base}/shards/train-000003.tar: size request failed: HTTP 403 "
                                         "Forbidden (not retried); the run stopped: checkpoint "), err[-2000:]
    assert not [r for r in caplog.records if "retry" in r.getMessage()]  # 403: not retried
    base.server.stop()
    code, err = _train(capsys, tmp_path / "unreachable", f"{base}/shards/{TRAIN}")
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"error: {base}/shards/shards.json: size request failed after 3 attempts: connection failed ("), err[-2000:]
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 2  # data.remote_retries=2
    assert not (tmp_path / "unreachable").exists()


def test_http_shards_are_spooled_for_the_workers_and_the_spool_is_emptied(shards, http_server, tmp_path,
                                                                          monkeypatch):
    """Remote shards reach the workers as local spool files (offsets, not pickled bytes); a file
    goes once its batches are decoded, the folder when the stream ends; a SIGKILLed run's folder
    is removed by the next spool."""
    from vitflow.data.wds import spool as wdsspool

    monkeypatch.setattr(wdsspool, "spool_root", lambda: tmp_path)
    dead = tmp_path / f"{wdsspool.PREFIX}999999999-x"  # no such process
    dead.mkdir()
    (dead / "00000001.tar").write_bytes(b"left by a killed run")
    _, out = shards
    src = open_shard_stream(f"{http_server(out.parent)}/shards/{TRAIN}", "train")
    transform = eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1)))
    loader, per_epoch = shard_loader(src, transform, 4, 0, 16, (0, 0), 0, 1, 2, 2)
    items = next(iter(loader.sampler)).items
    assert all(isinstance(d, tuple) and d[0].startswith(str(tmp_path)) for _, d, _, _ in items)
    it, on_disk = iter(loader), []
    for _ in range(3 * per_epoch):  # three epochs: 6 shards read three times
        batch = next(it)
        assert not batch["bad"] and len(batch["labels"]) == 4
        on_disk.append(len(list(tmp_path.glob(f"{wdsspool.PREFIX}{os.getpid()}-*/*.tar"))))
    assert not dead.exists()
    assert 0 < max(on_disk) < 18  # spooled files come and go: never all 18 shard reads of the three epochs
    loader.sampler.close()  # what TrainLoader.close does (the DataLoader keeps the iteration suspended)
    assert list(tmp_path.glob(f"{wdsspool.PREFIX}{os.getpid()}-*")) == []


def test_a_prefetched_shard_is_downloaded_once_and_taken_by_the_fetch(shards, http_server, tmp_path):
    """Spool.prefetch starts the next shard's download; fetch waits for it (no second request);
    a failed prefetch is raised by its fetch; close cancels what was not fetched."""
    from vitflow.data.remote.fs import RemoteError
    from vitflow.data.wds.spool import Spool

    _, out = shards
    base = http_server(out.parent)
    first, second = (f"{base}/shards/train-{i:06d}.tar" for i in range(2))
    spool = Spool(lag=1, root=tmp_path)
    spool.prefetch(first)
    spool.prefetch(first)  # already on its way: not asked twice
    path = spool.fetch(first)
    requests = base.server.requests
    assert Path(path).read_bytes() == (out / "train-000000.tar").read_bytes()
    assert Path(spool.fetch(second)).read_bytes() == (out / "train-000001.tar").read_bytes()
    assert base.server.requests == requests + 2  # the second, not prefetched: its HEAD and GET now
    base.server.forbid("shards/train-000002.tar")
    spool.prefetch(f"{base}/shards/train-000002.tar")
    with pytest.raises(RemoteError, match="403"):
        spool.fetch(f"{base}/shards/train-000002.tar")
    spool.prefetch(second)
    spool.close()
    deadline = time.monotonic() + 10  # a download under way when the spool closed removes its own file
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.iterdir())



def test_a_freed_spool_file_is_written_over_by_the_next_download(shards, http_server, tmp_path):
    """A file read through and released is renamed (its old name gone) and kept while the spool
    holds fewer files than its peak; the next download writes over it in place (same inode),
    cut to the new shard's length; the spool never holds more files than its peak."""
    from vitflow.data.wds.spool import Spool

    _, out = shards
    base = http_server(out.parent)
    url = [f"{base}/shards/train-{i:06d}.tar" for i in range(6)]
    spool = Spool(lag=1, root=tmp_path)
    first, second = spool.fetch(url[0]), spool.fetch(url[1])  # the peak: two files
    spool.hold(first)
    spool.done_reading(first)  # still held by an item
    spool.done_reading(second)  # freed: kept to be written over
    assert not Path(second).exists() and Path(first).exists()
    spool.release([first])  # freed too
    assert not Path(first).exists()
    free = {p.stat().st_ino: p for p in spool.folder.iterdir()}
    assert len(free) == 2 and all(p.name.startswith("free-") for p in free.values())
    for p in free.values():  # longer than any shard: the download must cut what it does not write over
        p.write_bytes(p.read_bytes() + b"x" * 30000)
    last = spool.fetch(url[5])
    assert os.stat(last).st_ino in free
    assert Path(last).read_bytes() == (out / "train-000005.tar").read_bytes()
    third = spool.fetch(url[2])
    assert Path(third).read_bytes() == (out / "train-000002.tar").read_bytes()
    assert {os.stat(last).st_ino, os.stat(third).st_ino} == set(free)  # both reused, none new
    assert len(list(spool.folder.iterdir())) == 2
    spool.done_reading(last)
    spool.done_reading(third)
    spool.fetch(url[3])  # a third file alive at once: the peak grows to three
    assert len(list(spool.folder.iterdir())) == 2  # one freed file reused, one kept
    folder = spool.folder
    spool.close()
    assert not folder.exists()


class _SlowTransform:
    """A transform that takes 20 ms an image: a worker still decodes the last batches when the
    main process finds the sampler exhausted."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.transform(image)


def test_a_stream_of_k_epochs_ends_there_and_downloads_no_shard_of_the_next(shards, http_server):
    """``epochs=1``: the loader gives one epoch of batches, then ends; the shuffle buffer does
    not fill from the next epoch's shards (each shard downloaded once); the last batches, still
    decoding when the sampler ends, read their spooled images; ``close`` removes the spool."""
    _, out = shards
    base = http_server(out.parent)
    src = open_shard_stream(f"{base}/shards/{TRAIN}", "train")
    transform = _SlowTransform(eval_transform(Preprocess(8, 1.0, "bilinear", (0, 0, 0), (1, 1, 1))))
    requests = base.server.requests
    spools = set(spool_root().glob(f"{PREFIX}{os.getpid()}-*"))
    loader, per_epoch = shard_loader(src, transform, 4, 0, 16, (0, 0), 0, 1, 1, 2, epochs=1)
    batches = list(itertools.islice(loader, 12))
    assert len(batches) == per_epoch == 10
    assert [b["bad"] for b in batches] == [[]] * 10
    assert sum(len(b["labels"]) for b in batches) == 40
    assert base.server.requests - requests == 2 * 6  # a HEAD (its size) and a GET a shard, once each
    loader.sampler.close()
    assert set(spool_root().glob(f"{PREFIX}{os.getpid()}-*")) == spools
