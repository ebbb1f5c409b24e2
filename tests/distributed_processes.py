"""The processes of a distributed deployment, each in its own process group so that a test can
kill -9 it: an SGLang stand-in worker (tests/fake_sglang.py) and `nextstate serve | judge | learn`,
forked from one process that imported them (tests/forked_process.py): seven of them at once
would otherwise spend the test's first 15 s importing torch."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx

from tests.forked_process import ForkedCommand
from tests.real_engines.server_process import ServerProcess

# What `nextstate judge` and `nextstate learn` log once they work (nextstate/workers.py).
READY_LINES = {"judge": "judging the inbox as", "learn": "learning from the ready samples"}


class FakeWorker(ServerProcess):
    """An SGLang stand-in on the tiny model, in a process of its own; restarts on its port."""

    distribution = "nextstate"

    def __init__(self, model_dir: Path, log_dir: Path, name: str) -> None:
        self.name = name
        super().__init__(model_dir, log_dir, python=sys.executable)

    def launch(self) -> ForkedCommand:
        return ForkedCommand("tests.fake_sglang", [str(self.port), str(self.model_dir)], self.environment(),
                             self.log_path, cwd=self.log_path.parent)

    def served(self) -> list[str | None]:
        """The adapter of each reply this worker generated since it started (None: the base model)."""
        return httpx.get(f"{self.url}/fake/generations", timeout=10).json()

    def set_mode(self, mode: str) -> None:
        """tests/fake_sglang.py's failure mode, in the worker's process."""
        httpx.post(f"{self.url}/fake/mode", json={"mode": mode}, timeout=10).raise_for_status()


class NextstateProcess(ServerProcess):
    """`nextstate KIND` with `env` on top of the test's environment, its data dir of its own."""

    distribution = "nextstate"
    start_timeout_s = 180.0

    def __init__(self, kind: str, env: dict[str, str], log_dir: Path, name: str) -> None:
        self.kind, self.env, self.name = kind, env, name
        super().__init__(Path("."), log_dir, python=sys.executable)

    def launch(self) -> ForkedCommand:
        return ForkedCommand("nextstate.cli", [self.kind], self.environment(), self.log_path, cwd=self.log_path.parent)

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **self.env, "NEXTSTATE_PORT": str(self.port),
                "NEXTSTATE_DATA_DIR": str(self.log_path.parent / self.name)}

    def ready(self) -> bool:
        if self.kind != "serve":
            return READY_LINES[self.kind] in self.log_tail(200_000)
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def pause(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)  # it holds everything, answers nothing

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)
