"""A real SGLang server on this machine, started and stopped by the tests that need it.

`.ci/real-engines` installs a pinned SGLang into its own environment and names its Python in
NEXTSTATE_SGLANG_PYTHON. The server runs SGLang's torch-native CPU path (the flags are those that
work on a CPU-only machine: see the issue that added them, and deploy/README.md for the tested
version), on a free port of 127.0.0.1, in its own process group, stopped by PID. Without the
variable the `real_engine` tests skip on a developer's machine and fail in CI (CI=true), where
.ci/real-engines must have provided it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.background_server import free_port

SGLANG_PYTHON = "NEXTSTATE_SGLANG_PYTHON"
START_TIMEOUT_S = 240.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 16


def sglang_python() -> str:
    python = os.environ.get(SGLANG_PYTHON)
    if python and Path(python).is_file():
        return python
    message = f"needs a real SGLang: run .ci/real-engines, or set {SGLANG_PYTHON} to the Python of an SGLang environment"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def sglang_version(python: str) -> str:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


class RealSGLang:
    """`url`, `restart()` and `stop()`, as tests/fake_sglang.FakeSGLang has them."""

    def __init__(self, model_dir: Path, log_dir: Path, python: str | None = None) -> None:
        self.python = python or sglang_python()
        self.version = sglang_version(self.python)
        self.model_dir = model_dir
        self.log_path = log_dir / "sglang.log"
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--disable-overlap-schedule", "--sleep-on-idle",
            "--mem-fraction-static", "0.1", "--max-total-tokens", "8192",
            "--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(MAX_LORA_RANK),
            # no --max-loaded-loras: SGLang would then evict and reload by itself, and a client
            # that leaked one adapter per version would go unseen
            "--lora-target-modules", *LORA_TARGETS, "--max-loras-per-batch", "2",
        ]

    def start(self) -> None:
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
               "NEXTSTATE_SGLANG_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, cwd=self.log_path.parent)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SGLang did not come up in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # its scheduler and tokenizer processes too
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        """A restarted SGLang: the same URL, nothing loaded."""
        self.stop()
        self.start()

    def loaded_adapters(self) -> dict[str, str]:
        """What SGLang itself says it has loaded: name → path (its /v1/models)."""
        models = httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return {m["id"]: m["root"] for m in models if m.get("parent")}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
