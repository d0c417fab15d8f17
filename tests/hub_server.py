"""A stand-in Hugging Face hub on 127.0.0.1: the part of the hub's HTTP API that
``huggingface_hub.snapshot_download`` speaks (a repository's revision, its file tree, each file's
``resolve`` URL with the ``X-Repo-Commit`` / ``ETag`` headers), serving folders the test wrote, so
that ``model.pretrained=auto`` downloads for real through ``HF_ENDPOINT``. It counts the requests
(``.requests``) so a test can check that a cached backbone needed no network.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "4f0c3b1e5d2a69788c9b0a1d2e3f405162738495"


class HubServer:
    """Serves ``repos`` (``{"ORG/NAME": folder}``, every file of a folder one hub file) at one
    commit, :data:`COMMIT`, for any revision; ``url`` is the ``HF_ENDPOINT``; ``stop()`` ends it."""

    def __init__(self, repos: dict[str, Path]):
        self.repos, self.requests, self.lock = {k: Path(v) for k, v in repos.items()}, 0, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                server._answer(self, body=False)

            def do_GET(self) -> None:
                server._answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        with self.lock:
            self.requests += 1
        path = unquote(urlparse(h.path).path)
        status, headers, data = 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            repo = next((r for r in self.repos if rest.startswith(r + "/") or rest == r), None)
            if repo:
                files = self._files(repo)
                tail = rest[len(repo):].strip("/")
                if tail.startswith("tree/"):
                    listing = [{"type": "file", "path": f, "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in files.items()]
                    status, data = 200, json.dumps(listing).encode()
                else:  # the repository (at a revision)
                    status, data = 200, json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                                    "siblings": [{"rfilename": f} for f in files]}).encode()
                headers = {"Content-Type": "application/json"}
        elif "/resolve/" in path:
            repo, _, rest = path.strip("/").partition("/resolve/")
            filename = rest.partition("/")[2]
            if repo in self.repos and filename in (files := self._files(repo)):
                data = files[filename].read_bytes()
                status = 200
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                           "Content-Type": "application/octet-stream"}
            else:
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
