"""A real Redis server for the tests, from the machine's packages (Debian's `redis-server`,
which .ci/run installs), on a free loopback port with nothing kept on disk, stopped by PID.
Without it the tests that need it skip on a developer's machine and fail in CI (CI=true)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.background_server import free_port


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
        if binary is None:
            message = "needs Redis's server (Debian: apt-get install redis-server; .ci/run installs it)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        self.port = free_port()
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._wait()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait(self) -> None:
        import socket

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not come up in 30 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
