"""Remote storage (vitflow.data.remote.fs) against real servers on 127.0.0.1 (tests/servers.py): a
static HTTP server with Range support and moto's S3 server. Bytes, images and labels read over
HTTP and S3 equal the local ones; transient errors are retried, 403 / 404 / unreachable stores end
in one line naming the URL."""

from __future__ import annotations

import base64
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import HYMENOPTERA_TAR, make_folder, need, tar_folder
from servers import copy_into, s3_upload, self_signed_cert
from vitflow.config import DataConfig
from vitflow.data.prepare import prepare
from vitflow.data.remote import fs as remote
from vitflow.data.remote.cache import cache_name, download, parse_size
from vitflow.data.remote.fs import RemoteError, expand_urls, open_random, open_stream, read_bytes
from vitflow.data.remote.http import MAX_REDIRECTS, get_file
from vitflow.data.remote.store import with_retries
from vitflow.data.sources.base import DataError
from vitflow.data.sources.dispatch import open_split

pytestmark = pytest.mark.usefixtures("quick_retries")  # tests/servers.py: 2 retries, 10 ms apart


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A served folder: ``photos.tar`` (8 real hymenoptera photos, train/val), ``packed`` (those
    photos as a packed JPEG dataset), ``raw`` (a small PNG folder packed raw), ``labels.csv``."""
    root = tmp_path_factory.mktemp("store")
    photos = tmp_path_factory.mktemp("photos") / "photos"
    with tarfile.open(need(HYMENOPTERA_TAR)) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
        for split in ("train", "val"):
            for cls in ("ants", "bees"):
                for m in [m for m in members if f"/{split}/{cls}/" in m.name][:2]:
                    dst = photos / split / cls / Path(m.name).name
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(tf.extractfile(m).read())
    tar_folder(photos, root / "photos.tar")
    prepare(photos, root / "packed", fmt="jpeg", max_side=96)
    prepare(make_folder(tmp_path_factory.mktemp("small") / "small", per_class=3, split="train"), root / "raw",
            fmt="raw")
    rows = ["path,label"] + [f"photos/{p.relative_to(photos).as_posix()},{p.parent.name}"
                             for p in sorted(photos.rglob("*.jpg"))]
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    (root / "classes.txt").write_text("bees\nants\n")
    copy_into(photos, root)
    return root


def same_split(a, b) -> None:
    assert a.classes == b.classes and len(a) == len(b) > 0
    assert np.array_equal(a.labels, b.labels)
    for i in range(len(a)):
        assert torch.equal(a.load(i), b.load(i)), a.name(i)


def test_open_stream_and_range_reads_equal_the_local_bytes_over_http_and_s3(store, http_server, s3_server):
    local = (store / "photos.tar").read_bytes()
    base = http_server(store)
    s3 = s3_upload(*s3_server, store / "photos.tar")
    for url in (f"{base}/photos.tar", s3):
        with open_stream(url) as f:
            assert f.read(1000) == local[:1000] and f.read() == local[1000:]
        f = open_random(url)
        assert f.size == len(local) and f.pread(12345, 777) == local[12345:13122]
        f.seek(-100, 2)
        assert f.read() == local[-100:]
    assert base.server.requests > 0


@pytest.mark.parametrize("kind", ["photos.tar", "packed", "raw", "labels.csv"])
def test_tar_in_place_packed_and_label_file_over_http_and_s3_give_the_local_images(store, http_server, s3_server,
                                                                                    kind):
    base = http_server(store)
    s3 = s3_upload(*s3_server, store / kind)
    if kind == "labels.csv":
        s3_upload(*s3_server, store / "photos")
    split = "val" if kind in ("photos.tar", "packed") else "train"
    local = open_split(store / kind, split)
    for url in (f"{base}/{kind}", s3):
        same_split(local, open_split(url, split))
    if kind in ("photos.tar", "packed"):
        same_split(open_split(store / kind, "train"), open_split(f"{base}/{kind}", "train"))
    if kind == "labels.csv":  # a class list from a URL too
        cfg = DataConfig(classes=f"{base}/classes.txt")
        same_split(open_split(store / kind, split, cfg=DataConfig(classes=str(store / "classes.txt"))),
                   open_split(f"{base}/{kind}", split, cfg=cfg))


def test_two_503s_then_success_is_retried_and_logged(store, http_server, caplog):
    base, local = http_server(store), (store / "photos.tar").read_bytes()
    f = open_random(f"{base}/photos.tar")
    base.server.fail_next(2, 503)
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        assert f.pread(5000, 300) == local[5000:5300]  # one GET an attempt
        base.server.fail_next(2, 503)
        assert read_bytes(f"{base}/labels.csv") == (store / "labels.csv").read_bytes()  # stat: HEAD, then GET
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert [m.split(" failed")[0] for m in retries[:2]] == [f"{base}/photos.tar: read of bytes 5000-5299"] * 2
    assert len(retries) >= 3 and all("(HTTP 503 Service Unavailable); retry" in m for m in retries)
    assert base.server.failures == 0


def test_download_is_checked_against_the_size_and_a_cut_body_is_fetched_again(store, http_server, s3_server,
                                                                               tmp_path, caplog):
    base, local = http_server(store), (store / "photos.tar").read_bytes()
    base.server.cut_next(len(local) // 3)  # the connection closes after a third of the announced bytes
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        assert download(f"{base}/photos.tar", tmp_path / "http.tar") == len(local)
    assert (tmp_path / "http.tar").read_bytes() == local and base.server.cut is None
    assert any(r.getMessage().startswith(f"{base}/photos.tar: download failed") and "retry 1 of" in r.getMessage()
               for r in caplog.records)
    url = s3_upload(*s3_server, store / "photos.tar")
    assert download(url, tmp_path / "s3.tar") == len(local) and (tmp_path / "s3.tar").read_bytes() == local
    base.server.stop()
    with pytest.raises(RemoteError, match=rf"^{base}/photos.tar: (size request|download) failed after 3 attempts"):
        download(f"{base}/photos.tar", tmp_path / "gone.tar")


def test_http_download_follows_redirects_sends_basic_auth_and_retries_a_503(store, http_server, tmp_path, caplog):
    base, local = http_server(store), (store / "photos.tar").read_bytes()
    base.server.redirect("moved/photos.tar", "/photos.tar")  # a relative Location, resolved against the URL
    assert download(f"{base}/moved/photos.tar", tmp_path / "moved.tar") == len(local)
    assert (tmp_path / "moved.tar").read_bytes() == local
    port = base.rsplit(":", 1)[1]
    assert get_file(f"http://ann:p%40ss@127.0.0.1:{port}/photos.tar", tmp_path / "auth.tar") == len(local)
    assert base.server.last_authorization == "Basic " + base64.b64encode(b"ann:p@ss").decode()
    base.server.fail_next(1, 503)  # the GET's answer: retried (with_retries) like any transient error
    url = f"{base}/photos.tar"
    with caplog.at_level(logging.WARNING, "vitflow.data"):
        assert with_retries(url, "download", lambda: get_file(url, tmp_path / "again.tar")) == len(local)
    assert [r.getMessage() for r in caplog.records if "retry" in r.getMessage()][0].startswith(
        f"{url}: download failed (HTTP 503 Service Unavailable); retry 1 of 2")
    base.server.redirect("a.tar", "/b.tar")
    base.server.redirect("b.tar", "/a.tar")
    with pytest.raises(RemoteError) as e:
        with_retries(f"{base}/a.tar", "download", lambda: get_file(f"{base}/a.tar", tmp_path / "loop.tar"))
    assert str(e.value) == (f"{base}/a.tar: download failed: HTTPStatusError: HTTP 302 Found: more than "
                            f"{MAX_REDIRECTS} redirects (not retried)")


def test_http_download_encodes_names_and_keeps_credentials_across_a_same_origin_redirect(http_server, tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    body = bytes(range(256)) * 12
    (root / "a b ä.tar").write_bytes(body)
    base = http_server(root)
    assert download(f"{base}/a b ä.tar", tmp_path / "x.tar") == len(body)  # sent as /a%20b%20%C3%A4.tar
    assert (tmp_path / "x.tar").read_bytes() == body
    port = base.rsplit(":", 1)[1]
    base.server.redirect("old.tar", f"http://127.0.0.1:{port}/a%20b%20%C3%A4.tar")  # absolute, same origin
    assert get_file(f"http://ann:pw@127.0.0.1:{port}/old.tar", tmp_path / "y.tar") == len(body)
    assert base.server.last_authorization == "Basic " + base64.b64encode(b"ann:pw").decode()


def test_403_and_404_fail_at_once_with_one_line_naming_the_url(store, http_server, caplog):
    base = http_server(store)
    base.server.forbid("photos.tar")
    with caplog.at_level(logging.WARNING, "vitflow.data"), pytest.raises(RemoteError) as e:
        open_split(f"{base}/photos.tar", "train")
    assert str(e.value) == f"{base}/photos.tar: size request failed: HTTP 403 Forbidden (not retried)"
    assert e.value.status == 403
    with pytest.raises(RemoteError, match=r"/missing\.tar: size request failed: HTTP 404") as e:
        open_random(f"{base}/missing.tar")
    assert "\n" not in str(e.value) and not [r for r in caplog.records if "retry" in r.getMessage()]


def test_unreachable_store_is_retried_then_named_in_one_line(store, http_server, s3_server, caplog):
    base = http_server(store)
    base.server.stop()
    s3 = s3_upload(*s3_server, store / "labels.csv")
    with caplog.at_level(logging.WARNING, "vitflow.data"), pytest.raises(RemoteError) as e:
        read_bytes(f"{base}/labels.csv")
    msg = str(e.value)
    assert msg.startswith(f"{base}/labels.csv: size request failed after 3 attempts: connection failed (")
    assert "\n" not in msg and e.value.transient
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 2
    with pytest.raises(RemoteError, match=r"nothere\.csv: size request failed: S3 error NoSuchKey \(HTTP 404\)"):
        read_bytes(s3.replace("labels.csv", "nothere.csv"))


def test_the_test_server_answers_ranges_as_http_says(store, http_server):
    import urllib.error
    import urllib.request

    base, body = http_server(store), (store / "labels.csv").read_bytes()

    def get(spec: str) -> tuple[int, bytes]:
        req = urllib.request.Request(f"{base}/labels.csv", headers={"Range": spec})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    assert get("bytes=0-9") == (206, body[:10]) and get("bytes=10-") == (206, body[10:])
    assert get("bytes=-10") == (206, body[-10:]) and get(f"bytes=-{len(body) + 5}") == (206, body)
    assert get("bytes=-") == get("bytes=-0") == get(f"bytes={len(body)}-") == (416, b"")


def test_a_server_ignoring_range_requests_gives_the_right_bytes_and_one_warning(store, caplog):
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(store)))  # no Range support
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url, local = f"http://127.0.0.1:{httpd.server_port}/photos.tar", (store / "photos.tar").read_bytes()
        with caplog.at_level(logging.WARNING, "vitflow.data"):
            f = open_random(url)
            assert f.pread(1000, 300) == local[1000:1300] and f.pread(5, 7) == local[5:12]
        warned = [r.getMessage() for r in caplog.records if "Range" in r.getMessage()]
        assert warned == [f"{url}: the server ignores Range requests: every read downloads the whole file "
                          f"({len(local)} bytes); serve the files with one that answers them (nginx, Apache, S3 ...)"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_untrusted_tls_certificate_fails_at_once_naming_the_url(store, http_server, tmp_path, caplog):
    base = http_server(store, certfile=self_signed_cert(tmp_path))  # HTTPS with a certificate nobody signed
    assert base.startswith("https://127.0.0.1:")
    with caplog.at_level(logging.WARNING, "vitflow.data"), pytest.raises(RemoteError) as e:
        read_bytes(f"{base}/labels.csv")
    msg = str(e.value)
    assert msg.startswith(f"{base}/labels.csv: size request failed: TLS certificate not trusted (")
    assert msg.endswith("(not retried)") and "\n" not in msg and not e.value.transient
    assert not [r for r in caplog.records if "retry" in r.getMessage()] and base.server.requests == 0


def test_an_unknown_host_fails_at_once_a_resolver_that_cannot_answer_now_is_retried():
    import socket

    import aiohttp
    from aiohttp.client_reqrep import ConnectionKey

    from vitflow.data.remote.store import _classify

    key = ConnectionKey("no-such-host.invalid", 443, True, True, None, None, None)

    def dns(errno: int) -> Exception:  # what fsspec's HTTP stat raises: "not found", the connector's error as cause
        err = FileNotFoundError("https://no-such-host.invalid/a.tar")
        err.__cause__ = aiohttp.ClientConnectorDNSError(key, socket.gaierror(errno, "resolver says"))
        return err

    url = "https://no-such-host.invalid/a.tar"
    assert _classify(dns(socket.EAI_NONAME), url) == (None, False, "unknown host (resolver says)")
    assert _classify(dns(socket.EAI_AGAIN), url)[:2] == (None, True)  # the resolver may answer later
    assert _classify(ConnectionRefusedError(111, "refused"), url)[:2] == (None, True)


def test_cli_names_a_forbidden_url_in_one_error_line(store, http_server, capsys):
    from vitflow.cli import main

    base = http_server(store)
    base.server.forbid("packed/meta.json")
    assert main(["train", f"data.path={base}/packed", "train.total_steps=1", "data.remote_retries=0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {base}/packed/meta.json: size request failed: HTTP 403 Forbidden (not retried)")


def test_a_planned_run_reads_with_the_runs_retries(store, http_server, capsys):
    from vitflow.cli import main

    base = http_server(store)
    base.server.stop()  # nothing listens: the plan's first read (the shard index) fails
    assert main(["train", f"data.path={base}/train-{{000000..000001}}.tar", "data.remote_retries=1",
                 "data.remote_backoff=0.01"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: {base}/shards.json: size request failed after 2 attempts: connection failed (")


def test_expand_urls_braces_lists_globs_and_s3_listing(tmp_path, s3_server):
    for i in range(3):
        (tmp_path / f"train-{i:04d}.tar").write_bytes(b"x")
    (tmp_path / "extra.tar").write_bytes(b"y")
    assert expand_urls(f"{tmp_path}/train-{{0000..0002}}.tar::{tmp_path}/{{extra,train-0001}}.tar") == [
        str(tmp_path / f"train-{i:04d}.tar") for i in range(3)] + [str(tmp_path / "extra.tar"),
                                                                      str(tmp_path / "train-0001.tar")]
    assert expand_urls(f"{tmp_path}/*.tar") == sorted(str(p) for p in tmp_path.glob("*.tar"))
    assert expand_urls("https://h/s-{8..10}.tar") == ["https://h/s-8.tar", "https://h/s-9.tar", "https://h/s-10.tar"]
    with pytest.raises(DataError, match=r"^data.path: pattern .*/val-\{0..3\}.tar matched no shard$"):
        expand_urls(f"{tmp_path}/val-{{0..3}}.tar")
    with pytest.raises(DataError, match="2 of 4 missing"):
        expand_urls(f"{tmp_path}/train-{{0001..0004}}.tar")
    for p in tmp_path.glob("train-*.tar"):
        s3_upload(*s3_server, p, "shards")
    _, bucket = s3_server
    assert expand_urls(f"s3://{bucket}/shards/train-*.tar") == [f"s3://{bucket}/shards/train-{i:04d}.tar"
                                                                 for i in range(3)]
    with pytest.raises(DataError, match="matched no shard"):
        expand_urls(f"s3://{bucket}/shards/val-*.tar")


def test_local_cache_serves_copies_evicts_least_recent_and_never_keeps_a_partial_file(store, tmp_path, http_server):
    base = http_server(store)
    cache = tmp_path / "cache"
    files = ["labels.csv", "packed/meta.json", "photos.tar"]
    sizes = [(store / f).stat().st_size for f in files]
    remote.configure(retries=0, backoff=0.01, cache_dir=str(cache), cache_max_size=sizes[0] + sizes[1])
    for f in files[:2]:
        assert open_stream(f"{base}/{f}").read() == (store / f).read_bytes()
    base.server.stop()
    assert read_bytes(f"{base}/labels.csv") == (store / "labels.csv").read_bytes()  # from the cache
    with pytest.raises(RemoteError):  # a failed download leaves nothing under the final name
        open_stream(f"{base}/photos.tar")
    assert sorted(p.name for p in cache.iterdir()) == sorted(cache_name(f"{base}/{f}") for f in files[:2])
    base.server.start()
    assert open_stream(f"{base}/photos.tar").read() == (store / "photos.tar").read_bytes()
    assert [p.name for p in cache.iterdir()] == [cache_name(f"{base}/photos.tar")]  # the older two evicted
    assert parse_size("20GiB") == 20 * 2**30 and parse_size("500MB") == 500 * 10**6 and parse_size(None) is None


def test_s3_errors_are_sorted_into_transient_and_permanent_as_s3fs_raises_them():
    from botocore.exceptions import ClientError, EndpointConnectionError
    from s3fs.errors import translate_boto_error

    from vitflow.data.remote.store import _classify

    def s3(code, status):
        err = ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        return _classify(translate_boto_error(err), "s3://b/k.tar")

    assert s3("SlowDown", 503) == (503, True, "S3 error SlowDown (HTTP 503): SlowDown message")
    assert s3("InternalError", 500)[:2] == (500, True)
    assert s3("AccessDenied", 403)[:2] == (403, False)
    assert s3("NoSuchKey", 404)[:2] == (404, False)
    assert _classify(EndpointConnectionError(endpoint_url="http://x"), "s3://b/k")[1]
    import aiohttp  # a keep-alive connection the server closed mid-answer: transient, retried

    assert _classify(aiohttp.ServerDisconnectedError(), "http://x/k.tar")[:2] == (None, True)
    assert _classify(ValueError("odd"), "http://x/k.tar")[:2] == (None, False)
    e = RemoteError("s3://b/k: failed", "s3://b/k", 503, True)
    import pickle

    back = pickle.loads(pickle.dumps(e))  # a loader worker's error reaches the trainer whole
    assert (str(back), back.url, back.status, back.transient) == (str(e), e.url, 503, True)
