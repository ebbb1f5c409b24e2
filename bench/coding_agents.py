"""Real coding agents against nextstate, each set up as docs/agents.md says, their traffic kept.

    npm install --prefix ~/agents @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332 opencode-ai@1.18.33
    python -m bench.coding_agents --bin ~/agents/node_modules/.bin              # each agent, the embedded model
    python -m bench.coding_agents --bin ... --agent codex --scripted            # a long-context scripted model
    python -m bench.coding_agents --bin ... --keep tests/data/coding-agents     # keep the traffic as fixtures

Each agent gets a scratch home holding only the recipe's config, a scratch folder with three
files, and one task, "List the files here.", run non-interactively (`codex exec`, `claude -p`,
`opencode run`). nextstate serves it through bench/agent_traffic.py's proxy. `--scripted` serves
a scripted model with a 64k window instead of SmolLM2: its first reply calls the agent's own
shell tool, its second answers, so the agent's whole tool loop runs as it would on a capable
model. Reported per agent: its exit status and last words, each request's path and status, the
sessions nextstate made of them and which turns were side turns. Nothing here runs in CI (it
needs npm and the CLIs); tests/test_coding_agents.py replays the kept traffic.
"""

from __future__ import annotations

import argparse
import json
import os
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


@dataclass
class Agent:
    """How one CLI is set up and run: `setup(home, base_url, model)` writes its config and
    returns its environment; `command(model)` is the run."""

    name: str
    api: str
    setup: Callable[[Path, str, str], dict[str, str]]
    command: Callable[[str], list[str]]
    shell_call: str  # a scripted reply calling the agent's own shell tool
    before: tuple[str, ...] = ()  # scripted replies to the agent's own requests before its first turn


def codex_setup(home: Path, root: str, model: str) -> dict[str, str]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(codex_config(root, model, small=model == SMALL_MODEL))
    return {"CODEX_HOME": str(home / ".codex")}


def codex_config(root: str, model: str, small: bool) -> str:
    """docs/agents.md's Codex recipe; `small`: its lines for an 8k window (no web search, no
    sub-agent or goal tools: their schemas alone are 2.7k tokens)."""
    lean = 'web_search = "disabled"\n\n[features]\nmulti_agent = false\ngoals = false\n\n' if small else ""
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
    return {"ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": "{key}", "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


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
                    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>'),
    "opencode": Agent("opencode", "chat", opencode_setup,
                      lambda model: ["opencode", "run", TASK],
                      '<tool_call>\n{"name": "bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>',
                      before=("Files in this folder",)),  # its title generator asks first
}


def run_agent(agent: Agent, bin_dir: Path, server, model: str, out: Path, timeout: float) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, required=True, help="where the CLIs are (node_modules/.bin)")
    parser.add_argument("--agent", choices=sorted(AGENTS), action="append", help="default: all three")
    parser.add_argument("--scripted", action="store_true", help="a scripted 64k-window model instead of SmolLM2")
    parser.add_argument("--keep", type=Path, help="keep each agent's traffic here, as <agent>-<model>.jsonl")
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
                result = run_agent(agent, args.bin, server, model, out, args.timeout)
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(out, args.keep / f"{name}-{'scripted' if args.scripted else 'smollm2'}.jsonl")
            finally:
                server.stop()
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)


def scripted_engine(agent: Agent):
    """An engine factory for a scripted model with a 64k window: a call to the agent's shell
    tool, then an answer, then "ok" for anything after (titles, summaries)."""
    from tests.conftest import scripted_factory

    factory, _ = scripted_factory(replies=[*agent.before, f"Let me look.\n{agent.shell_call}",
                                           "The files here are README.md, hello.py and notes.txt."], max_context=65536)
    return factory


if __name__ == "__main__":
    main()
