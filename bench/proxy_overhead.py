"""What does nextstate add to every request? The same chats sent to the engine directly and through nextstate.

    python -m bench.proxy_overhead              # scripted stub engine at 1, 8, 64 clients + the embedded model
    python -m bench.proxy_overhead --smol       # the embedded run on SmolLM2 instead of the tiny model

The engine is an SGLang-shaped server in its own process (tests/fake_sglang.py, the same
/generate contract the real SGLang serves). Two setups:

* **stub** — the engine answers every request with one fixed 32-token reply and no model at
  all (`--scripted`): nothing but HTTP and the proxy costs time, so this is the proxy's own
  cost. The reply is streamed token by token, with `--token-ms` between tokens (0 = as fast
  as the event loop goes).
* **stub, judging off** — the stub at 1 client with NEXTSTATE_JUDGE_ENABLED=0: the proxy
  alone, without the judge's work on the same cores.
* **stub, judging off, agent prompt** — the same with OpenClaw's requests (its trimmed
  system prompt and 5 tools, ~3.8k tokens, growing by a turn each request; SmolLM2's
  tokenizer): what the proxy costs on the requests a personal agent sends.
* **embedded** — the same engine server runs the real embedded model (tiny, or SmolLM2 with
  --smol); a third column serves it in-process inside nextstate (the default deployment).
* **litellm** — for scale, the LiteLLM proxy (`litellm[proxy]`, installed on first use into
  bench/.venv-litellm, never into nextstate's environment; a generated master key, since it
  refuses the known default ones) in front of an OpenAI-shaped stub (bench/openai_stub.py)
  streaming the same reply in the same tokens, driven by the same client in the same run;
  "direct" is then the stub's own /v1/chat/completions. `--no-litellm` skips it.

"direct": a client streams `/generate` with the prompt's token ids (rendered beforehand, so
templating counts as proxy cost). "nextstate": a stock client (no session headers) streams
`/v1/chat/completions` through `nextstate serve` in its own process, with API-key auth,
session inference, turn buffering, JSONL records and judging on (a stub OpenAI-compatible
judge in a fourth process, tests/judge_server.py, answering instantly) and the learner off.
Each client plays conversations of 10 turns, each turn extending the last, so every request
is a main turn whose reply gets judged when the next turn arrives. Reported per setup and concurrency: first-token and
full-reply latency p50/p99, the added milliseconds and the ratio. All processes share this
machine's cores: on a 2-core box the client, proxy, judge and engine compete, which inflates
both columns at 64 clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.models import bench_model
from bench.prefix_reuse import openclaw_follow_up, openclaw_start
from bench.report import percentile, pyplot, save
from tests.background_server import free_port
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.core.stores.keys import KeyStore

TURNS_PER_CONVERSATION = 10
LITELLM_VENV = Path(__file__).resolve().parent / ".venv-litellm"
LITELLM_REQUIREMENT = "litellm[proxy]"
STUB_REPLY = "The quick brown fox jumps over the lazy dog, and then it naps in the warm sun all afternoon."


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited before answering:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class Conversation:
    """One client's chat: the messages grow by the (deterministic) reply and a new question.
    With `agent`, an agent's: OpenClaw's trimmed system prompt (9k characters), its 5 tools
    and timestamped user messages (bench/prefix_reuse.py), ~3.8k tokens from the first turn."""

    def __init__(self, client_id: int, agent: bool = False) -> None:
        self.client_id, self.agent = client_id, agent
        if agent:
            self.messages, self.tools = openclaw_start()  # [system, its first user message]
        else:
            self.messages = [{"role": "system", "content": f"You are assistant number {client_id}."}]
            self.tools = None

    def next_request(self, turn: int) -> list[dict]:
        if self.agent:
            if turn % TURNS_PER_CONVERSATION:
                self.messages.append(openclaw_follow_up(turn % TURNS_PER_CONVERSATION))
        else:
            self.messages.append({"role": "user", "content": f"Question {turn} from client {self.client_id}: what next?"})
        return list(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def _stream_direct(http: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}, "stream": True}
    started, first, out = time.perf_counter(), None, []
    async with http.stream("POST", f"{url}/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event["output_ids"] and first is None:
                first = time.perf_counter()
            out += event["output_ids"]
    return first - started, time.perf_counter() - started, out


async def _stream_proxy(
    http: httpx.AsyncClient, url: str, key: str, messages: list[dict], max_tokens: int, tools: list[dict] | None = None,
) -> tuple[float, float, str]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if tools:
        body |= {"tools": tools, "tool_choice": "auto"}
    started, first, text = time.perf_counter(), None, []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
    return first - started, time.perf_counter() - started, "".join(text)


async def _drive(
    target: str, url: str, clients: int, turns: int, max_tokens: int, renderer: ChatRenderer, key: str | None,
    agent: bool = False,
) -> dict:
    """`clients` conversations at once, `turns` requests each; returns latency lists in ms."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def play(c: int) -> list[tuple[float, float]]:
            convo, out = Conversation(c, agent), []
            for turn in range(turns):
                if turn and turn % TURNS_PER_CONVERSATION == 0:
                    convo = Conversation(c, agent)  # a fresh chat, before the context fills up
                messages = convo.next_request(turn)
                if target == "direct":
                    ids = renderer.render(messages, convo.tools, "auto" if convo.tools else None).ids
                    ttft, total, reply_ids = await _stream_direct(http, url, ids, max_tokens)
                    text = renderer.tokenizer.decode(reply_ids, skip_special_tokens=True)
                else:
                    ttft, total, text = await _stream_proxy(http, url, key, messages, max_tokens, convo.tools)
                convo.answered(text)
                if turn:  # the first request of each client warms its connection
                    out.append((1000 * ttft, 1000 * total))
            return out

        per_client = await asyncio.gather(*(play(c) for c in range(clients)))
    pairs = [p for client in per_client for p in client]
    return {"ttft_ms": [p[0] for p in pairs], "total_ms": [p[1] for p in pairs]}


def _summary(direct: dict, proxied: dict) -> dict:
    out = {"requests": len(proxied["total_ms"])}
    for metric in ("ttft_ms", "total_ms"):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            d, p = percentile(direct[metric], q), percentile(proxied[metric], q)
            out[f"{metric[:-3]}_{name}"] = {"direct_ms": round(d, 2), "nextstate_ms": round(p, 2),
                                            "added_ms": round(p - d, 2), "ratio": round(p / d, 2)}
    return out


class Stack:
    """The engine server, the stub judge and `nextstate serve`, each in its own process."""

    def __init__(self, model_dir: Path, engine_args: list[str], in_process: bool = False, judge: bool = True) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.TemporaryDirectory()
        self.engine_url = None
        env = {"NEXTSTATE_DATA_DIR": self.tmp.name, "NEXTSTATE_MODEL": str(model_dir), "NEXTSTATE_SERVED_MODEL_NAME": "m",
               "NEXTSTATE_LEARN": "0", "NEXTSTATE_LOG_LEVEL": "warning", "NEXTSTATE_MAX_CONCURRENT_GENERATIONS": "64",
               # one key drives every client here: its per-user limit would turn the load into 429s
               "NEXTSTATE_MAX_PARALLEL_PER_USER": "1000"}
        try:
            if not in_process:
                port = free_port()
                self.procs.append(_spawn(["-m", "tests.fake_sglang", str(port), str(model_dir), *engine_args]))
                self.engine_url = f"http://127.0.0.1:{port}"
                _wait_up(f"{self.engine_url}/health", self.procs[-1])
                env.update(NEXTSTATE_ENGINE="sglang", NEXTSTATE_SGLANG_URL=self.engine_url)
            if judge:
                judge_port = free_port()
                self.procs.append(_spawn(["-m", "tests.judge_server", str(judge_port)]))
                _wait_up(f"http://127.0.0.1:{judge_port}/docs", self.procs[-1])
                env.update(NEXTSTATE_JUDGE_BASE_URL=f"http://127.0.0.1:{judge_port}/v1", NEXTSTATE_JUDGE_MODEL="stub")
            else:
                env.update(NEXTSTATE_JUDGE_ENABLED="0")
            store = KeyStore(Path(self.tmp.name) / "nextstate.sqlite3")
            self.keys = [store.create(f"user{i}")[1] for i in range(8)]
            store.close()
            port = free_port()
            self.procs.append(_spawn(["-m", "nextstate.cli", "serve"], {**env, "NEXTSTATE_PORT": str(port)}))
            self.proxy_url = f"http://127.0.0.1:{port}"
            _wait_up(f"{self.proxy_url}/healthz", self.procs[-1])
            self.serve_pid = self.procs[-1].pid
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.tmp.cleanup()


def litellm_bin() -> Path:
    """The `litellm` command of bench/.venv-litellm, made on first use (needs PyPI)."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(f"installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_REQUIREMENT], check=True)
    return exe


class LiteLLMStack:
    """The OpenAI-shaped stub and the LiteLLM proxy in front of it, each in its own process."""

    def __init__(self, model_dir: Path, token_ms: float) -> None:
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.TemporaryDirectory()
        self.key = "sk-" + secrets.token_hex(16)
        try:
            port = free_port()
            self.procs.append(_spawn(["-m", "bench.openai_stub", str(port), str(model_dir), "--reply", STUB_REPLY,
                                      "--token-ms", str(token_ms)]))
            self.stub_url = f"http://127.0.0.1:{port}"
            _wait_up(f"{self.stub_url}/health", self.procs[-1])
            config = Path(self.tmp.name) / "litellm.yaml"
            config.write_text(json.dumps({  # JSON is YAML
                "model_list": [{"model_name": "m", "litellm_params": {
                    "model": "openai/m", "api_base": f"{self.stub_url}/v1", "api_key": "stub"}}],
                "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
            }))
            port = free_port()
            self.procs.append(subprocess.Popen(
                [str(litellm_bin()), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                env={**os.environ, "LITELLM_MASTER_KEY": self.key, "LITELLM_LOG": "ERROR"},
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            self.proxy_url = f"http://127.0.0.1:{port}"
            _wait_up(f"{self.proxy_url}/health/liveliness", self.procs[-1])
        except BaseException:
            self.close()
            raise

    def measure(self, clients: int, turns: int) -> dict:
        renderer = None  # both legs speak chat completions: no pre-rendering
        direct = asyncio.run(_drive("proxy", self.stub_url, clients, turns, 64, renderer, self.key))
        proxied = asyncio.run(_drive("proxy", self.proxy_url, clients, turns, 64, renderer, self.key))
        return _summary(direct, proxied)

    def close(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.tmp.cleanup()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux), None where /proc has no answer."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    stack: Stack, renderer: ChatRenderer, clients: int, turns: int, max_tokens: int, direct_url: str | None,
    agent: bool = False,
) -> dict:
    """Latencies of both legs, and the CPU `nextstate serve` spent per reply: steadier than
    latency on a few shared cores, where the client, the engine and the judge compete."""
    key = stack.keys[0]
    runs = {}
    if direct_url:
        runs["direct"] = asyncio.run(_drive("direct", direct_url, clients, turns, max_tokens, renderer, None, agent))
    before = cpu_seconds(stack.serve_pid)
    runs["nextstate"] = asyncio.run(_drive("proxy", stack.proxy_url, clients, turns, max_tokens, renderer, key, agent))
    after = cpu_seconds(stack.serve_pid)
    if before is not None and after is not None:
        runs["cpu_ms_per_reply"] = round(1000 * (after - before) / (clients * turns), 2)
    return runs


def headline(result: dict) -> str:
    stub = [r for r in result["rows"] if r["setup"] == "stub"]
    text = "stub engine, added per reply (p50): " + ", ".join(
        f"{r['clients']} clients +{r['total_p50']['added_ms']:.1f} ms (x{r['total_p50']['ratio']})" for r in stub)
    off = [r for r in result["rows"] if r["setup"] == "stub, judging off"]
    if off:
        text += f"; judging off, 1 client +{off[0]['total_p50']['added_ms']:.1f} ms"
        if off[0].get("nextstate_cpu_ms_per_reply") is not None:
            text += f" ({off[0]['nextstate_cpu_ms_per_reply']:.1f} ms of nextstate's CPU per reply)"
    agent = [r for r in result["rows"] if r["setup"] == "stub, judging off, agent prompt"]
    if agent:
        text += f"; OpenClaw's prompts +{agent[0]['total_p50']['added_ms']:.1f} ms"
    lite = [r for r in result["rows"] if r["setup"] == "litellm" and r["clients"] == 1]
    if lite:
        text += f"; LiteLLM, 1 client +{lite[0]['total_p50']['added_ms']:.1f} ms"
    return text


def plot(result: dict):
    rows = result["rows"]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "ttft", "first token"), (axes[1], "total", "whole reply")):
        setups = (("stub", "o"), ("stub, judging off", "^"), ("stub, judging off, agent prompt", "v"), ("embedded", "s"),
                  ("litellm", "x"))
        for setup, marker in setups:
            pts = [r for r in rows if r["setup"] == setup]
            if not pts:
                continue
            xs = [r["clients"] for r in pts]
            ax.plot(xs, [r[f"{metric}_p50"]["direct_ms"] for r in pts], marker + "--", label=f"{setup}: direct p50")
            ax.plot(xs, [r[f"{metric}_p50"]["nextstate_ms"] for r in pts], marker + "-", label=f"{setup}: nextstate p50")
            ax.plot(xs, [r[f"{metric}_p99"]["nextstate_ms"] for r in pts], marker + ":", label=f"{setup}: nextstate p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.legend(fontsize=7)
    fig.suptitle("nextstate vs the engine directly (streaming chat, p50/p99)", fontsize=10)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--turns", type=int, default=None, help="requests per client (default: enough for ~200 per point)")
    parser.add_argument("--token-ms", type=float, default=0.0, help="stub engine: delay between tokens")
    parser.add_argument("--smol", action="store_true", help="embedded run on SmolLM2 instead of the tiny model")
    parser.add_argument("--embedded-clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM comparison")
    parser.add_argument("--no-embedded", action="store_true", help="skip the embedded-model rows")
    parser.add_argument("--no-agent", action="store_true", help="skip the OpenClaw-prompt row (it needs SmolLM2's tokenizer)")
    args = parser.parse_args()

    tiny = bench_model()
    renderer = ChatRenderer.from_dir(tiny)
    rows = []
    stack = Stack(tiny, ["--scripted", STUB_REPLY, "--token-ms", str(args.token_ms)])
    try:
        for clients in args.clients:
            turns = args.turns or max(4, 200 // clients + 1)
            runs = measure(stack, renderer, clients, turns, 64, stack.engine_url)
            rows.append({"setup": "stub", "clients": clients, **_summary(runs["direct"], runs["nextstate"]),
                         "nextstate_cpu_ms_per_reply": runs.get("cpu_ms_per_reply")})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stack.close()
    # The same at 1 client with judging off: what the proxy costs without the judge's work beside it.
    stack = Stack(tiny, ["--scripted", STUB_REPLY, "--token-ms", str(args.token_ms)], judge=False)
    try:
        runs = measure(stack, renderer, 1, args.turns or 201, 64, stack.engine_url)
        rows.append({"setup": "stub, judging off", "clients": 1, **_summary(runs["direct"], runs["nextstate"]),
                     "nextstate_cpu_ms_per_reply": runs.get("cpu_ms_per_reply")})
        print(json.dumps(rows[-1]), flush=True)
    finally:
        stack.close()

    if not args.no_agent:
        # An agent's request (OpenClaw, ~3.8k tokens with 5 tools; SmolLM2's tokenizer, since
        # the tiny model's turns it into 10k): what grows with the conversation.
        smol = bench_model(smol=True)
        stack = Stack(smol, ["--scripted", STUB_REPLY, "--token-ms", str(args.token_ms)], judge=False)
        try:
            runs = measure(stack, ChatRenderer.from_dir(smol), 1, args.turns or 101, 64, stack.engine_url, agent=True)
            rows.append({"setup": "stub, judging off, agent prompt", "clients": 1, **_summary(runs["direct"], runs["nextstate"]),
                         "nextstate_cpu_ms_per_reply": runs.get("cpu_ms_per_reply")})
            print(json.dumps(rows[-1]), flush=True)
        finally:
            stack.close()

    if not args.no_litellm:
        lite = LiteLLMStack(tiny, args.token_ms)
        try:
            for clients in args.clients:
                turns = args.turns or max(4, 200 // clients + 1)
                rows.append({"setup": "litellm", "clients": clients, **lite.measure(clients, turns)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            lite.close()

    model_dir = bench_model(smol=args.smol)
    renderer = ChatRenderer.from_dir(model_dir)
    stack, local = (None, None) if args.no_embedded else (Stack(model_dir, []), Stack(model_dir, [], in_process=True))
    try:
        for clients in [] if args.no_embedded else args.embedded_clients:
            turns = args.turns or (4 if args.smol else 12)
            runs = measure(stack, renderer, clients, turns, 16, stack.engine_url)
            in_process = measure(local, renderer, clients, turns, 16, None)["nextstate"]
            row = {"setup": "embedded", "clients": clients, **_summary(runs["direct"], runs["nextstate"])}
            row["in_process_nextstate"] = {f"{m[:-3]}_{n}": round(percentile(in_process[m], q), 2)
                                           for m in ("ttft_ms", "total_ms") for q, n in ((0.5, "p50"), (0.99, "p99"))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in (stack, local):
            if s is not None:
                s.close()

    result = {
        "benchmark": "proxy_overhead",
        "engine": f"stub: scripted 32-token reply, {args.token_ms} ms/token, no model (tests/fake_sglang.py --scripted); "
        f"embedded: {model_dir.name} behind the same SGLang-shaped server",
        "embedded_model": model_dir.name,
        "path": "direct = httpx streaming /generate with pre-rendered ids; nextstate = httpx streaming "
        "/v1/chat/completions through `nextstate serve` (auth, session inference, records, stub judge on, learner off)",
        "rows": rows,
    }
    save(result)


if __name__ == "__main__":
    main()
