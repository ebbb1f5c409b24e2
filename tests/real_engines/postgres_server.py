"""A real PostgreSQL server for the tests, from the machine's packages (Debian's `postgresql`,
which .ci/run installs), started on a free loopback port in a folder of its own and stopped by
PID. Without it the tests that need it skip on a developer's machine and fail in CI (CI=true).

PostgreSQL refuses to run as root: as root, its folder belongs to the `postgres` user the
package made, and the server runs as that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.background_server import free_port


def postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if found:
        return Path(found[-1]).parent
    message = "needs PostgreSQL's server (Debian: apt-get install postgresql; .ci/run installs it)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class PostgresServer:
    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.port = free_port()
        # not under pytest's tmp dir: that is private to root, and the server may run as postgres
        self.root = Path(tempfile.mkdtemp(prefix="nextstate-pg-"))
        self.user = pwd.getpwnam("postgres") if os.getuid() == 0 else None
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self._run([str(self.bin / "initdb"), "-D", str(self.root / "data"), "-U", "postgres", "--auth=trust",
                   "--no-sync", "-E", "UTF8"], check=True)
        self._start()

    def _start(self) -> None:
        log = (self.root / "server.log").open("ab")
        self.process = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(self.root / "data"), "-p", str(self.port), "-k", str(self.root),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **self._as_user())
        log.close()
        self._wait()

    def _shut_down(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # its fast shutdown
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def pause(self) -> None:
        """Stop the server, keeping its data (`resume` starts it again on the same port)."""
        self._shut_down()

    def resume(self) -> None:
        self._start()

    def restart(self) -> None:
        """What `pg_ctl restart -m fast` does: every connection ends, the data stays."""
        self._shut_down()
        self._start()

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_user(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _run(self, command: list[str], check: bool) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, check=check, **self._as_user())

    def _wait(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"PostgreSQL exited:\n{(self.root / 'server.log').read_text()[-3000:]}")
            ready = self._run([str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)], check=False)
            if ready.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError("PostgreSQL did not come up in 60 s")

    def fresh_database(self, name: str) -> str:
        """A new, empty database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._shut_down()
        shutil.rmtree(self.root, ignore_errors=True)
