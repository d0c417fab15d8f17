"""Real storage servers on 127.0.0.1 for the tests (imported by ``conftest.py``):

- ``http_server(root) -> base_url``: a threaded HTTP/1.1 static file server over ``root`` with
  Range requests (``206`` / ``416``; suffix ranges ``bytes=-N`` too; HTTPS with
  ``http_server(root, certfile=self_signed_cert(tmp_path))``), which Python's ``http.server`` lacks, file bodies sent by
  ``sendfile(2)`` as production servers send them. The URL is a ``str`` whose ``.server``
  (:class:`RangeServer`) can ``stop()`` and ``start()`` again on the same port (a server dying
  mid-epoch; by itself after N more requests, or N more for matching paths:
  ``die_after_requests``), answer the next N requests with an error (``fail_next(2, 503)``),
  cut the next body short (``cut_next``), redirect a path (``redirect("a.tar", "/b.tar")``),
  refuse paths with 403 (``forbid("x.tar")``), count requests (``.requests``) and keep the last
  ``Authorization`` header (``.last_authorization``).
- ``s3_server -> (endpoint_url, bucket)``: moto in server mode (``ThreadedMotoServer``, one per
  session) with a fresh bucket per test, fake credentials and ``AWS_ENDPOINT_URL`` set in the
  environment (children started with ``os.environ`` inherit them); :func:`s3_upload` copies files.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import ssl
import threading
import uuid
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RangeHandler(SimpleHTTPRequestHandler):
    """GET / HEAD of files under the served folder, with single-range ``Range: bytes=a-b``
    (HTTP/1.1 keep-alive connections)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body in separate writes: no 40 ms delayed-ACK stall per request

    def log_message(self, *args) -> None:  # quiet
        pass

    def _control(self) -> bool:
        """Apply the server's test switches; True when the request was answered here."""
        ctl: RangeServer = self.server.control  # type: ignore[attr-defined]
        with ctl.lock:
            ctl.requests += 1
            ctl.last_authorization = self.headers.get("Authorization")
            status = None
            if ctl.die_after is not None and ctl.die_match in self.path:
                ctl.die_seen += 1
            if ctl.die_after is not None and ctl.die_seen > ctl.die_after:
                ctl.die_after, ctl.dead = None, True
                threading.Thread(target=ctl.stop, daemon=True).start()
            if ctl.dead:
                status = -1
            elif ctl.failures:
                ctl.failures -= 1
                status = ctl.failure_status
            elif self.path.split("?")[0].lstrip("/") in ctl.forbidden:
                status = 403
            redirect = ctl.redirects.get(self.path.split("?")[0].lstrip("/"))
        if status is None and redirect is not None:
            self.send_response(302)
            self.send_header("Location", redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if status == -1:  # the server dies: this connection closes unanswered, the next are refused
            self.close_connection = True
            return True
        if status is not None:
            self.send_error(status)
            return True
        return self.command == "GET" and self._cut(ctl)

    def _cut(self, ctl: "RangeServer") -> bool:
        """``cut_next``: the whole file announced, its first bytes sent, the connection closed."""
        with ctl.lock:
            keep, ctl.cut = ctl.cut, None
        path = self.translate_path(self.path)
        if keep is None or not os.path.isfile(path):
            return False
        self.send_response(200)
        self.send_header("Content-Length", str(os.path.getsize(path)))
        self.end_headers()
        with open(path, "rb") as f:
            self.wfile.write(f.read(keep))
        self.close_connection = True
        return True

    def do_HEAD(self) -> None:
        if not self._control():
            super().do_HEAD()

    def do_GET(self) -> None:
        if self._control():
            return
        path = self.translate_path(self.path)
        m = RANGE.match(self.headers.get("Range", "").strip())
        if not os.path.isfile(path) or (m is None and self.headers.get("Range")):
            return super().do_GET()
        size = os.path.getsize(path)
        if m is None:  # the whole file, by sendfile(2) as below
            self.send_response(200)
            self.send_header("Content-type", self.guess_type(path))  # the headers of a HEAD (send_head)
            self.send_header("Content-Length", str(size))
            self.send_header("Last-Modified", self.date_time_string(os.path.getmtime(path)))
            self.end_headers()
            with open(path, "rb") as f:
                self.connection.sendfile(f, 0, size)
            return
        first, last = m.groups()
        if first == "":  # a suffix range: the last N bytes, the whole file when N exceeds it (RFC 9110 14.1.2)
            start, end = (max(0, size - int(last)), size - 1) if last not in ("", "0") else (size, size - 1)
        else:
            start, end = int(first), min(int(last or size - 1), size - 1)
        if start >= size or end < start:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        with open(path, "rb") as f:  # the body by sendfile(2), as production servers send files
            self.connection.sendfile(f, start, end - start + 1)

    def end_headers(self) -> None:
        if self.command != "GET" or "Content-Range" not in str(self._headers_buffer):
            self.send_header("Accept-Ranges", "bytes")
        super().end_headers()


class RangeServer:
    """A restartable static file server over ``root`` on ``127.0.0.1:port``."""

    def __init__(self, root: Path, port: int | None = None, certfile: Path | None = None):
        self.root, self.port, self.certfile = Path(root), port or free_port(), certfile
        self.lock = threading.Lock()
        self.failures, self.failure_status, self.requests = 0, 503, 0
        self.forbidden: set[str] = set()
        self.redirects: dict[str, str] = {}
        self.last_authorization: str | None = None  # the Authorization header of the last request
        self.die_after: int | None = None
        self.die_match, self.die_seen = "", 0
        self.cut: int | None = None
        self.dead = False
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.certfile else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> "RangeServer":
        ThreadingHTTPServer.allow_reuse_address = True
        self.dead = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), partial(RangeHandler, directory=str(self.root)))
        self._httpd.daemon_threads = True
        if self.certfile is not None:  # HTTPS with the certificate (and its key) in certfile
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(self.certfile)
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)
        self._httpd.control = self  # type: ignore[attr-defined]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self.dead = True  # open keep-alive connections too: their next request is closed unanswered
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status``."""
        with self.lock:
            self.failures, self.failure_status = n, status

    def die_after_requests(self, n: int, matching: str = "") -> None:
        """Stop (as a killed server) at request ``n + 1`` from now (counting only the requests whose
        path contains ``matching``, when given): that one is closed unanswered."""
        with self.lock:
            self.die_after, self.die_match, self.die_seen = n, matching, 0

    def cut_next(self, keep: int) -> None:
        """Answer the next GET with the whole file's length but only its first ``keep`` bytes."""
        with self.lock:
            self.cut = keep

    def redirect(self, rel: str, location: str) -> None:
        """Answer requests for ``rel`` (relative to the root) with ``302 Found`` to ``location``."""
        self.redirects[rel.lstrip("/")] = location

    def forbid(self, rel: str) -> None:
        """Answer 403 for the file ``rel`` (relative to the root)."""
        self.forbidden.add(rel.lstrip("/"))


def self_signed_cert(folder: Path) -> Path:
    """A PEM file holding a fresh self-signed certificate for ``127.0.0.1`` and its key (a
    certificate no client trusts: ``RangeServer(root, certfile=...)`` serves HTTPS with it)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)  # what a client checking the name matches against
            .sign(key, hashes.SHA256()))
    path = Path(folder) / "self-signed.pem"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()) + cert.public_bytes(serialization.Encoding.PEM))
    return path


class ServedURL(str):
    """The server's base URL (a ``str``), with the :class:`RangeServer` as ``.server``."""

    server: RangeServer


@pytest.fixture
def http_server():
    """Factory: ``http_server(root) -> base_url`` (a :class:`ServedURL`); stopped after the test."""
    servers: list[RangeServer] = []

    def serve(root: Path, certfile: Path | None = None) -> ServedURL:
        server = RangeServer(root, certfile=certfile).start()
        servers.append(server)
        url = ServedURL(server.url)
        url.server = server
        return url

    yield serve
    for s in servers:
        s.stop()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def quick_retries():
    """Remote reads retried twice, 10 ms apart, for the test (then vitflow's defaults again)."""
    from vitflow.data.remote import fs as remote

    remote.configure(retries=2, backoff=0.01)
    yield
    remote.configure(retries=5, backoff=1.0)


@pytest.fixture(scope="session")
def _moto_endpoint():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_server(_moto_endpoint, monkeypatch):
    """``(endpoint_url, bucket)``: a new empty bucket on the session's moto S3 server, with fake
    credentials and ``AWS_ENDPOINT_URL`` in ``os.environ`` for the test."""
    import boto3

    for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": _moto_endpoint}.items():
        monkeypatch.setenv(k, v)
    bucket = f"vitflow-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=_moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return _moto_endpoint, bucket


def s3_upload(endpoint: str, bucket: str, src: Path, prefix: str = "") -> str:
    """Upload the file or folder ``src`` under ``s3://bucket/prefix/NAME``; returns that URL."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    src = Path(src)
    key = "/".join(p for p in (prefix.strip("/"), src.name) if p)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if src.is_file() else f.relative_to(src).as_posix()
        client.upload_file(str(f), bucket, key if src.is_file() else f"{key}/{rel}")
    return f"s3://{bucket}/{key}"


def copy_into(src: Path, root: Path) -> Path:
    """Copy the file or folder ``src`` into the served folder ``root``; returns the copy."""
    dst = Path(root) / Path(src).name
    (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, dst)
    return dst


if __name__ == "__main__":  # python tests/servers.py FOLDER [PORT]: serve FOLDER (benchmarks, manual checks)
    import sys
    import time

    served = RangeServer(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None).start()
    print(served.url, flush=True)
    while True:
        time.sleep(3600)
