"""``vitflow serve`` started for real in a child process on 127.0.0.1 (a free port), for the
serving tests and the load benchmark's checks: :class:`Served` waits until ``/readyz`` answers."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from helpers import ENV
from servers import free_port


class Served:
    """``python -m vitflow serve SOURCE ARGS... --port P`` with its stderr in ``log``;
    ``url`` is ``http://127.0.0.1:P``. ``stop()`` sends SIGTERM and returns the exit status."""

    def __init__(self, source, *args: str, log: Path, ready_s: float = 180.0, env: dict | None = None,
                 verify: Path | None = None):
        self.port = free_port()
        # --tls-cert: a client that trusts that certificate only (and checks the name it is for)
        self.verify = ssl.create_default_context(cafile=str(verify)) if verify else True
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log = Path(log)
        cmd = [sys.executable, "-m", "vitflow", "serve", str(source), "--port", str(self.port), *args]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, env={**ENV, **(env or {})}, stdout=f, stderr=subprocess.STDOUT)
        self.wait_ready(ready_s)

    def wait_ready(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vitflow serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"vitflow serve not ready in {seconds} s:\n{self.log.read_text()}")

    def workers(self) -> list[int]:
        """The pids of the worker processes (the supervisor's children that run the app)."""
        out = []
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            for pid in Path(f"/proc/{self.proc.pid}/task/{tid}/children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    out.append(int(pid))
        return sorted(out)

    def rss_kib(self) -> int:
        """The worker processes' resident memory, summed (KiB, ``VmRSS``)."""
        return sum(int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) for pid in self.workers())

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


class Clients:
    """``n`` threads calling ``request()`` (an httpx call) again and again inside the ``with``
    block; ``outcomes``: ``(time.monotonic(), status)``, the status ``"hang"`` for a client
    timeout and ``"connection error"`` for a dropped or refused connection."""

    def __init__(self, n: int, request):
        self.request, self.outcomes, self.stop = request, [], threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(n)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                status = self.request().status_code
            except httpx.TimeoutException:
                status = "hang"
            except httpx.TransportError:
                status = "connection error"
            self.outcomes.append((time.monotonic(), status))

    def statuses(self) -> list:
        return [s for _, s in self.outcomes]

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def wait_until(done, seconds: float, every: float = 0.1) -> float | None:
    """Seconds until ``done()`` first holds, or None when it did not within ``seconds``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if done():
            return time.monotonic() - t0
        time.sleep(every)
    return None
