"""`nextstate` commands run as processes of their own, forked from one that imported nextstate once.

A process started with `python -m nextstate.cli` spends most of its start importing torch,
transformers and peft (3-5 s on two cores, against well under a second for everything else on
the tiny model). The crash test starts sixteen such servers and kills each at a chosen point,
so the imports were a quarter of the suite's time. multiprocessing's forkserver imports them
once, in a process of its own started clean (not forked from pytest and its threads), and
forks each command from there: still a separate process that the test can crash, kill or stop
with SIGTERM, with its own environment, output and exit status, running the real `main`.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What the commands import before they can answer (tests.crash_server arms a crash point in
# `nextstate serve`; tests.fake_sglang is an SGLang stand-in on the tiny model).
PRELOAD = ["nextstate.cli", "nextstate.app", "nextstate.workers", "peft", "tests.crash_server", "tests.fake_sglang"]


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _run(module: str, argv: list[str], env: dict[str, str], log: str, errors: str, cwd: str | None) -> None:
    """In the forked child: this command's environment, folder and output, then its `main(argv)`."""
    os.setsid()  # a group of its own, as `start_new_session` gives a subprocess: kill -9 reaches all of it
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, log), (2, errors)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    sys.exit(importlib.import_module(module).main(argv))


class ForkedCommand:
    """What `python -m MODULE ARGV` runs (MODULE's `main(argv)`), with `env` as its whole
    environment, in `cwd`, its output appended to `log` (its errors too, or to `errors`).
    Answers `pid`, `poll`, `returncode`, `terminate`, `kill` and `wait` as `subprocess.Popen` does."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None,
                 errors: Path | None = None) -> None:
        self.argv, self.log = [module, *argv], log
        self.process = _context().Process(
            target=_run, args=(module, argv, env, str(log), str(errors or log), cwd and str(cwd)), daemon=False)
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(["python", "-m", *self.argv], timeout or 0)
        return self.process.exitcode

    def output(self) -> str:
        return _read(self.log)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def nextstate_env(**settings: object) -> dict[str, str]:
    """This process's environment without its NEXTSTATE_* variables, plus `settings` as
    NEXTSTATE_<NAME>: a command started by a test reads only what the test sets, whatever the
    shell running pytest exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    return env | {f"NEXTSTATE_{name.upper()}": str(value) for name, value in settings.items()}


def run_cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m nextstate.cli ARGS`, forked, to its end: its status, stdout and stderr, as
    `subprocess.run(..., capture_output=True, text=True)` gives them."""
    with tempfile.TemporaryDirectory(prefix="nextstate-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        command = ForkedCommand("nextstate.cli", list(args), env, out, errors=err)
        try:
            status = command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait(10)
            raise
        return subprocess.CompletedProcess(["nextstate", *args], status, _read(out), _read(err))
