"""A real model server (SGLang, vLLM) on this machine, started and stopped by the tests that need it.

`.ci/real-engines` installs each pinned server into its own environment and names its Python in
an environment variable (NEXTSTATE_SGLANG_PYTHON, NEXTSTATE_VLLM_PYTHON). A server runs on a
free port of 127.0.0.1, in its own process group, stopped by PID. Without the variable the
`real_engine` tests skip on a developer's machine and fail in CI (CI=true), where
.ci/real-engines must have provided it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from tests.background_server import free_port


def engine_python(variable: str) -> str:
    python = os.environ.get(variable)
    if python and Path(python).is_file():
        return python
    message = f"needs a real engine server: run .ci/real-engines, or set {variable} to the Python of its environment"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def distribution_version(python: str, name: str) -> str:
    return subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


class ServerProcess:
    """`url`, `restart()`, `stop()` and `loaded_adapters()`, as the fakes have them."""

    name: ClassVar[str]
    python_variable: ClassVar[str]
    distribution: ClassVar[str]
    start_timeout_s: ClassVar[float] = 240.0

    def __init__(self, model_dir: Path, log_dir: Path, python: str | None = None) -> None:
        self.python = python or engine_python(self.python_variable)
        self.version = distribution_version(self.python, self.distribution)
        self.model_dir = model_dir
        self.log_path = log_dir / f"{self.name.lower()}.log"
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}

    def launch(self) -> subprocess.Popen:
        """The server's process, in a process group of its own, its output in its log."""
        with self.log_path.open("ab") as log:
            return subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                    start_new_session=True, cwd=self.log_path.parent)

    def start(self) -> None:
        self.process = self.launch()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not come up in {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """kill -9, its whole process group: no cleanup, as a crash or an OOM kill."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its worker processes too
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        """A restarted server: the same URL, nothing loaded."""
        self.stop()
        self.start()

    def loaded_adapters(self) -> dict[str, str]:
        """What the server itself says it has loaded: name → path (its /v1/models)."""
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return {m["id"]: m["root"] for m in models if m.get("parent")}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
