"""Real coding agents against nextstate, each set up as docs/agents.md says, their traffic kept.

    npm install --prefix ~/agents @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332 opencode-ai@1.18.33
    python -m bench.coding_agents --bin ~/agents/node_modules/.bin              # each agent, the embedded model
    python -m bench.coding_agents --bin ... --agent codex --scripted            # a long-context scripted model
    python -m bench.coding_agents --bin ... --keep tests/data/coding-agents     # keep the traffic as fixtures
    python -m bench.coding_agents --bin ... --interactive                       # in the terminal interface

Each agent gets a scratch home holding only the recipe's config, a scratch folder with three
files, and one task, "List the files here.", run non-interactively (`codex exec`, `claude -p`,
`opencode run`) or, with `--interactive`, typed into the agent's terminal interface in a
pseudo-terminal (pexpect) as a person would, the agent left once it has been idle for a while.
nextstate serves it through bench/agent_traffic.py's proxy. `--scripted` serves a scripted
model with a 64k window instead of SmolLM2: it calls the agent's own shell tool on the task and
answers once the tool's output follows, so the agent's whole tool loop runs as it would on a
capable model. Reported per agent: its exit status and last words, each request's path and
status, the sessions nextstate made of them and which turns were side turns. Nothing here runs in CI (it
needs npm and the CLIs); tests/test_coding_agents.py replays the kept traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.agent_traffic import RunningProxy
from bench.models import bench_model
from nextstate.core.settings import Settings
from tests.background_server import free_port, start_server

TASK = "List the files here."
FILES = {"notes.txt": "buy milk\n", "hello.py": "print('hello')\n", "README.md": "# scratch\n"}
KEY_VARIABLE = "NEXTSTATE_API_KEY"
SMALL_MODEL = "SmolLM2-135M-Instruct"  # the embedded default, an 8k window
# An interactive agent is done once no request has been under way for this long.
IDLE_S = 15.0
# The terminal's size and what an agent's interface has to settle before the task is typed.
TERMINAL = (40, 140)
SETTLE_S = 8.0
ESCAPES = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]")


@dataclass
class Agent:
    """How one CLI is set up and run: `setup(home, base_url, model)` writes its config and
    returns its environment; `command(model)` is the run."""

    name: str
    api: str
    setup: Callable[[Path, str, str], dict[str, str]]
    command: Callable[[str], list[str]]
    shell_call: str  # a scripted reply calling the agent's own shell tool
    terminal: Callable[[str], list[str]] | None = None  # its interactive interface (default: the agent's name)
    first_run: Callable[[Path, Path], None] = lambda home, work: None  # dialogs a person answers once, answered


def codex_setup(home: Path, root: str, model: str) -> dict[str, str]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(codex_config(root, model, small=model == SMALL_MODEL))
    return {"CODEX_HOME": str(home / ".codex")}


def codex_config(root: str, model: str, small: bool) -> str:
    """docs/agents.md's Codex recipe; `small`: its lines for an 8k window (no web search, no
    sub-agent or goal tools: their schemas alone are 2.7k tokens; no skills list: 0.5k)."""
    lean = ('web_search = "disabled"\n\n[features]\nmulti_agent = false\ngoals = false\n\n'
            '[skills]\ninclude_instructions = false\n\n') if small else ""
    return f'''model = "{model}"
model_provider = "nextstate"
{lean}
[model_providers.nextstate]
name = "nextstate"
base_url = "{root}/v1"
env_key = "{KEY_VARIABLE}"
wire_api = "responses"
'''


def claude_setup(home: Path, root: str, model: str) -> dict[str, str]:
    # the key as a bearer token: as ANTHROPIC_API_KEY its interface asks whether to use it (default No)
    return {"ANTHROPIC_BASE_URL": root, "ANTHROPIC_AUTH_TOKEN": "{key}", "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def claude_first_run(home: Path, work: Path) -> None:
    """Its welcome screen (which checks that api.anthropic.com answers: not on a machine offline)
    and the folder's trust dialog, as a person leaves them after answering each once."""
    state = {"hasCompletedOnboarding": True, "projects": {str(work): {"hasTrustDialogAccepted": True}}}
    (home / ".claude.json").write_text(json.dumps(state))


def opencode_setup(home: Path, root: str, model: str) -> dict[str, str]:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps(opencode_config(root, model), indent=2))
    return {}


def opencode_config(root: str, model: str) -> dict:
    """docs/agents.md's opencode recipe."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"nextstate/{model}",
        "provider": {"nextstate": {
            "npm": "@ai-sdk/openai-compatible", "name": "nextstate",
            "options": {"baseURL": f"{root}/v1", "apiKey": "{env:" + KEY_VARIABLE + "}"},
            "models": {model: {"name": model}},
        }},
    }


AGENTS = {
    "codex": Agent("codex", "responses", codex_setup,
                   lambda model: ["codex", "exec", "--skip-git-repo-check", TASK],
                   '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'),
    "claude": Agent("claude", "messages", claude_setup,
                    lambda model: ["claude", "-p", TASK, "--model", model, "--allowedTools", "Bash(ls:*)"],
                    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>',
                    terminal=lambda model: ["claude", "--model", model], first_run=claude_first_run),
    "opencode": Agent("opencode", "chat", opencode_setup,
                      lambda model: ["opencode", "run", TASK],
                      '<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>'),
}


def run_agent(agent: Agent, bin_dir: Path, server, model: str, out: Path, timeout: float, interactive: bool = False
              ) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        home, work = Path(scratch) / "home", Path(scratch) / "work"
        home.mkdir()
        work.mkdir()
        for name, text in FILES.items():
            (work / name).write_text(text)
        proxy = RunningProxy(server.root, out, free_port())
        key = server.key("alice")
        try:
            env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home), KEY_VARIABLE: key,
                   **{k: v.replace("{key}", key) for k, v in agent.setup(home, proxy.url, model).items()}}
            started = time.monotonic()
            if interactive:
                agent.first_run(home, work)
                command = agent.terminal(model) if agent.terminal else [agent.name]
                status, stdout, stderr = in_terminal(command, work, env, proxy, timeout)
            else:
                try:
                    done = subprocess.run(agent.command(model), cwd=work, env=env, capture_output=True, text=True,
                                          timeout=timeout, stdin=subprocess.DEVNULL)
                    status, stdout, stderr = done.returncode, done.stdout, done.stderr
                except subprocess.TimeoutExpired as late:
                    status, stdout, stderr = "timeout", str(late.stdout or ""), str(late.stderr or "")
            seconds = time.monotonic() - started
        finally:
            proxy.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    records = [r for r in server.records() if r["kind"] == "request"]
    return {
        "agent": agent.name, "api": agent.api, "exit": status, "seconds": round(seconds, 1),
        "stdout_tail": stdout[-1500:], "stderr_tail": stderr[-1500:],
        "requests": [[r["method"], r["path"], r["status"]] for r in rows],
        "turns": [{"session": r.get("session_id"), "type": r.get("turn_type"), "finish": r.get("finish_reason"),
                   "tool_calls": [c["function"]["name"] for c in (r.get("response") or {}).get("tool_calls") or []]}
                  for r in records],
    }


def in_terminal(command: list[str], work: Path, env: dict[str, str], proxy: RunningProxy, timeout: float
                ) -> tuple[str, str, str]:
    """Type the task into `command`'s terminal interface, wait until the agent has sent a request
    and then none for IDLE_S, and leave it with Ctrl-C twice: ("idle" or "timeout", what the
    screen showed without its escape codes, "")."""
    import pexpect

    child = pexpect.spawn(command[0], command[1:], cwd=str(work), env=env, dimensions=TERMINAL)
    shown = bytearray()

    def read_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and child.isalive():
            try:
                shown.extend(child.read_nonblocking(1 << 16, timeout=0.5))
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                return

    log = proxy.log
    try:
        read_for(SETTLE_S)
        child.send(TASK)
        read_for(1.0)
        child.send("\r")
        deadline, status = time.monotonic() + timeout, "timeout"
        while time.monotonic() < deadline and child.isalive():
            read_for(1.0)
            if log.count and not log.open and time.monotonic() - log.last > IDLE_S:
                status = "idle"
                break
        for _ in range(2):
            child.sendcontrol("c")
            read_for(2.0)
    finally:
        child.close(force=True)
    text = re.sub(r"\s+", " ", ESCAPES.sub(" ", shown.decode("utf-8", "replace")))  # redraws, not lines
    return status, text, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, required=True, help="where the CLIs are (node_modules/.bin)")
    parser.add_argument("--agent", choices=sorted(AGENTS), action="append", help="default: all three")
    parser.add_argument("--scripted", action="store_true", help="a scripted 64k-window model instead of SmolLM2")
    parser.add_argument("--keep", type=Path, help="keep each agent's traffic here, as <agent>-<model>.jsonl")
    parser.add_argument("--interactive", action="store_true", help="type the task into each agent's terminal interface")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    model_dir = bench_model(smol=True)
    model = "scripted-64k" if args.scripted else model_dir.name
    results = []
    for name in args.agent or sorted(AGENTS):
        agent = AGENTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            # the judge off with the scripted model: it would be served the agent's scripted replies
            settings = Settings(data_dir=Path(tmp), model=str(model_dir), port=free_port(), served_model_name=model,
                                learn=False, judge_enabled=not args.scripted)
            server = start_server(settings, *([scripted_engine(agent)] if args.scripted else []))
            try:
                out = Path(tmp) / "traffic.jsonl"
                result = run_agent(agent, args.bin, server, model, out, args.timeout, args.interactive)
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    mode = "-interactive" if args.interactive else ""
                    shutil.copy(out, args.keep / f"{name}{mode}-{'scripted' if args.scripted else 'smollm2'}.jsonl")
            finally:
                server.stop()
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)


ANSWER = "The files here are README.md, hello.py and notes.txt."


def scripted_reply(agent: Agent, prompt: str, json_schema: object) -> str:
    """What the scripted model says to a prompt: a title to a title request (as JSON where a
    schema asks for one: Codex's), the answer once the tool's output follows the task, a call to
    the agent's shell tool on the task, else "ok". By what the prompt holds, not by the order the
    requests come in: an interactive agent asks for its title while the task runs."""
    if json_schema is not None:
        return '{"title": "List the files"}'
    if "You are a title generator" in prompt:  # opencode's
        return "Files in this folder"
    if TASK in prompt and all(name in prompt[prompt.rfind(TASK):] for name in FILES):
        return ANSWER
    return f"Let me look.\n{agent.shell_call}" if TASK in prompt else "ok"


def scripted_engine(agent: Agent):
    """An engine factory for a scripted model with a 64k window that answers as `scripted_reply` says."""
    from tests.conftest import scripted_factory

    factory, _ = scripted_factory(max_context=65536, respond=lambda prompt, sampling: scripted_reply(
        agent, prompt, sampling.json_schema))
    return factory


if __name__ == "__main__":
    main()
