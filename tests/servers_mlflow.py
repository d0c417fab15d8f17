"""A real MLflow tracking server for the tests: ``mlflow server`` as a subprocess on 127.0.0.1 with
a SQLite backend store and proxied artifacts (``--serve-artifacts``), so that a client logs
parameters, metrics and files over HTTP only. Starting one takes seconds (its database
migrations, the web app), so a test module shares one: import the fixtures into the test file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 180  # a loaded CI machine is slow to import the server's web stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MLflowServer:
    """``mlflow server`` started at once, waited for (``/health``) when :attr:`url` is first read."""

    def __init__(self, root: Path):
        self.port, self.root = free_port(), root
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--serve-artifacts",
               "--artifacts-destination", str(root / "artifacts")]
        self.log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._ready = False

    @property
    def url(self) -> str:
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    self._ready = r.status == 200
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server not up after {START_TIMEOUT_S} s") from None
                time.sleep(0.3)
        return base

    def stop(self) -> None:
        if self.proc.poll() is None:  # its own process group: the server and its web worker; a test's
            os.killpg(self.proc.pid, signal.SIGKILL)  # database needs no orderly shutdown
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An :class:`MLflowServer` for the module, started when the first test asks for it; its
    ``url`` waits until the server answers."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow_server"))
    yield server
    server.stop()
