"""A real PostgreSQL server for the tests: Debian's ``postgresql`` (``.ci/run`` installs it),
``initdb`` into a temporary folder and ``pg_ctl start`` listening on 127.0.0.1 only, on a free
port, with password authentication for a test role. As root (CI), the server runs as the
``postgres`` user the package creates (PostgreSQL refuses to run as root). Import the fixture
into the test file: ``postgres_url`` is a fresh database's SQLAlchemy URL per test.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from servers import free_port

PASSWORD = "vitflow-test"


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))  # Debian keeps them off PATH
    return versions[-1] if versions else None


class PostgresServer:
    """``initdb`` + ``pg_ctl start`` in ``root``; :meth:`database` creates a database; :meth:`stop`."""

    def __init__(self, root: Path):
        initdb, self.pg_ctl, self.psql = _bin("initdb"), _bin("pg_ctl"), _bin("psql")
        if not (initdb and self.pg_ctl and self.psql):
            pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
        self.port, self.data = free_port(), root / "data"
        self.as_user = os.geteuid() == 0
        pw = root / "pw"
        pw.write_text(PASSWORD + "\n")
        if self.as_user:
            pg = pwd.getpwnam("postgres")
            for p in (root, pw):
                os.chown(p, pg.pw_uid, pg.pw_gid)
        self._run([initdb, "-D", str(self.data), "-U", "vitflow", "--pwfile", str(pw), "-A", "scram-sha-256",
                   "--no-sync", "-E", "UTF8"])
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(root / "server.log"), "-w", "-t", "60", "start",
                   "-o", f"-h 127.0.0.1 -p {self.port} -k {root} -c fsync=off"])

    def _run(self, cmd: list[str]) -> str:
        if self.as_user:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr or out.stdout}")
        return out.stdout

    def database(self) -> str:
        """A new, empty database: its SQLAlchemy URL (``postgresql://vitflow:...@127.0.0.1:PORT/NAME``)."""
        name = f"t{uuid.uuid4().hex[:12]}"
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        out = subprocess.run([self.psql, "-h", "127.0.0.1", "-p", str(self.port), "-U", "vitflow", "-d", "postgres",
                              "-c", f"CREATE DATABASE {name}"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return f"postgresql://vitflow:{PASSWORD}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._run([self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"])


@pytest.fixture(scope="module")
def postgres_server():
    root = Path(tempfile.mkdtemp(prefix="vitflow-postgres-"))  # under /tmp: the postgres user can reach it
    try:
        server = PostgresServer(root)
        yield server
        server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server) -> str:
    return postgres_server.database()
