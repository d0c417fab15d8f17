"""``vitflow serve``: uvicorn serving the application in worker processes under uvicorn's
supervisor.

The parent process prepares the model once (:func:`~vitflow.infer.serve.backends.prepare`:
a bad source fails here with one line; ``--backend auto`` is timed here, not in every worker),
binds the socket and starts ``--workers`` processes that each load the prepared model, warm it
up and only then accept connections. uvicorn's supervisor (``uvicorn.supervisors.Multiprocess``)
checks the workers every half second and starts a new one in place of one that died (a
``SIGKILL``, an out-of-memory kill): the others keep answering meanwhile, the new one joins once
warmed up.

With ``--tls-cert`` / ``--tls-key`` uvicorn answers HTTPS only. ``SIGHUP`` to the parent makes
every worker read its API keys again (:mod:`.auth`).

``SIGTERM`` (or ``SIGINT``) to the parent drains: the workers stop accepting connections, answer
every request they accepted (queued ones included; each has its ``--timeout``), then exit, and the
parent exits with status 0.
"""

from __future__ import annotations

import gc
import os
import signal
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Callable

from vitflow.infer.runtimes.openvino import tuned_settings
from vitflow.infer.serve.auth import KEYS_ENV, keys_from_env, loopback, read_keys
from vitflow.infer.serve.backends import prepare
from vitflow.infer.serve.settings import ENV_VAR, ServeSettings

APP = "vitflow.infer.serve.app:app_from_env"


def describe(s: ServeSettings) -> str:
    """The start-up line: what is served, how, and where."""
    where = f"{'https' if s.tls_cert else 'http'}://{s.host}:{s.port}"
    backend = s.backend
    if backend == "openvino":
        t = tuned_settings()
        backend += f" with vitflow's tuned settings: {t['precision']} float layers, {t['hint']} hint, dynamic shapes"
    return (f"serving {s.name} ({s.version}, backend {backend}, {s.torch_threads()} thread(s) each) on {where} "
            f"with {s.workers} worker(s): max batch {s.max_batch}, max wait {s.max_wait_ms:g} ms, max queue "
            f"{s.max_queue} images, timeout {s.timeout:g} s; API docs at {where}/docs")


def _supervisor_class():
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        """uvicorn's supervisor that, on SIGTERM / SIGINT, closes its own copy of the listening socket
        before the workers drain: once they have closed theirs, a new connection is refused at once
        instead of waiting in the kernel's backlog until the parent exits."""

        def terminate_all(self) -> None:
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

        def handle_hup(self) -> None:
            """SIGHUP: each worker reads its API keys again, in place (uvicorn's own restarts the
            workers, dropping the requests a lone worker holds)."""
            for p in self.processes:
                if p.is_alive() and p.pid:
                    os.kill(p.pid, signal.SIGHUP)

    return Supervisor


def access(settings: ServeSettings) -> int:
    """The number of API keys the service will require (read here once, so a bad file stops the
    start with one line), and a warning when a port other hosts reach needs none.

    Raises:
        KeyFileError: an unreadable key file, or a bad key (:func:`~vitflow.infer.serve.auth.read_keys`).
    """
    keys = len(read_keys(settings.api_key_file, keys_from_env()))  # (none configured: 0)
    if not keys and not loopback(settings.host):
        print(f"warning: --host {settings.host} without --api-key-file: anyone who reaches this port can use the model "
              f"(set --api-key-file FILE or {KEYS_ENV}, or put a proxy with authentication in front)", file=sys.stderr)
    return keys


def check_tls(settings: ServeSettings) -> None:
    """Load the certificate and key once here, so that a pair that does not fit stops the start
    with one line (in the workers it would kill each one at start-up, and the supervisor would
    start them again forever). Raises ValueError naming the files."""
    if not settings.tls_cert:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(settings.tls_cert, settings.tls_key)
    except (ssl.SSLError, OSError) as e:
        files = f"--tls-cert {settings.tls_cert}" + (f" --tls-key {settings.tls_key}" if settings.tls_key else "")
        raise ValueError(f"{files}: not a PEM certificate and its own private key ({e.reason or e})") from None


def run_server(settings: ServeSettings, say: Callable[[str], None] = print) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status (0 after a drain, 1 when the workers
    could not start). Raises FileNotFoundError / ValueError for a bad source or option, before
    anything listens."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    keys = access(settings)
    check_tls(settings)
    with tempfile.TemporaryDirectory(prefix="vitflow-serve-") as tmp:
        prepared = prepare(settings, tmp, say)
        gc.collect()  # the parent's copies of the models go; the workers load their own
        metrics_dir = Path(tmp) / "metrics"
        metrics_dir.mkdir()
        os.environ[ENV_VAR] = prepared.to_json()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # read by prometheus_client in each worker
        config = uvicorn.Config(APP, factory=True, host=prepared.host, port=prepared.port, workers=prepared.workers,
                                log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=int(prepared.timeout) + 5,
                                ssl_certfile=prepared.tls_cert, ssl_keyfile=prepared.tls_key)
        say(describe(prepared) + (f"; {keys} API key(s) required" if keys else ""))
        supervisor = _supervisor_class()(config, sockets=[config.bind_socket()])
        supervisor.run()
        return 1 if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes) else 0
