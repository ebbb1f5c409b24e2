"""Does judging slow serving down? Chat latency with the judge off, remote, and in-process.

    python -m bench.judge_overhead            # tiny test model: the proxy's own overhead
    python -m bench.judge_overhead --smol     # embedded SmolLM2: in-process judge shares the CPU

A stock client (no headers) plays conversations whose every turn gives the previous reply a
next state, so every request after the first triggers m PRM + m hint votes. Each setup runs
with no pause between turns (the worst case: judging always overlaps a request) and with a
short think time (a person or agent reading the reply), when judging waits for a quiet moment. Three runs:
`off` (NEXTSTATE_JUDGE_ENABLED=0), `remote` (a stub OpenAI-compatible judge over HTTP that
answers instantly, run in its own process — tests/judge_server.py, clearly not a model) and `in-process` (the served
base model judges itself, as by default). Writes bench/results/judge_overhead-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.models import bench_model, bench_server
from bench.report import percentile, pyplot, save
from tests.background_server import free_port

USER_TURNS = [
    "Can you help me plan a dinner party?",
    "No, I meant a vegetarian one.",
    "Great, thanks. What about dessert?",
    "That's wrong, I said no eggs.",
    "Perfect, thank you!",
]


def _wait_for(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def run(model_dir: Path, conversations: int, max_tokens: int, judge: str, votes: int, think_s: float) -> dict:
    overrides: dict = {"prm_votes": votes, "judge_max_tokens": 64}
    stub = None
    if judge == "off":
        overrides["judge_enabled"] = False
    elif judge == "remote":
        # In its own process, as a remote judge would be: no GIL shared with the proxy.
        port = free_port()
        stub = subprocess.Popen([sys.executable, "-m", "tests.judge_server", str(port)])
        _wait_for(f"http://127.0.0.1:{port}/docs")
        overrides.update(judge_base_url=f"http://127.0.0.1:{port}/v1", judge_model="stub")
    try:
        with bench_server(model_dir, **overrides) as server:
            client = server.client(server.key("bench"))
            latencies = []
            for c in range(conversations):
                messages = [{"role": "system", "content": f"You are assistant #{c}."}]
                for text in USER_TURNS:
                    messages.append({"role": "user", "content": text})
                    started = time.perf_counter()
                    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
                    latencies.append(time.perf_counter() - started)
                    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                    time.sleep(think_s)  # the user reads the reply before answering
            serve_end = time.perf_counter()
            server.drain_judge(timeout=600)
            drain_s = time.perf_counter() - serve_end
            samples = server.app.state.services.samples.samples()
    finally:
        if stub is not None:
            stub.terminate()
            stub.wait(10)
    return {
        "judge": judge,
        "think_ms": round(think_s * 1000),
        "requests": len(latencies),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 2),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2),
        "mean_ms": round(1000 * statistics.fmean(latencies), 2),
        "samples_judged": len(samples),
        "judge_drain_after_last_request_s": round(drain_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smol", action="store_true", help="use the embedded SmolLM2 instead of the tiny model")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--votes", type=int, default=3)
    parser.add_argument("--think-ms", type=float, nargs="+", default=[0, 250], help="pause between a reply and the next turn")
    args = parser.parse_args()

    model_dir = bench_model(smol=args.smol)
    conversations = args.conversations or (4 if args.smol else 20)
    runs = []
    for think_ms in args.think_ms:
        group = [
            run(model_dir, conversations, args.max_tokens, judge, args.votes, think_ms / 1000)
            for judge in ("off", "remote", "in-process")
        ]
        for r in group:
            r["p50_added_ms"] = round(r["p50_ms"] - group[0]["p50_ms"], 2)
            r["p99_added_ms"] = round(r["p99_ms"] - group[0]["p99_ms"], 2)
        runs += group
    result = {
        "benchmark": "judge_overhead",
        "model": model_dir.name,
        "conversations": conversations,
        "turns_per_conversation": len(USER_TURNS),
        "max_tokens": args.max_tokens,
        "votes_per_kind": args.votes,
        "runs": runs,
    }
    print(json.dumps(result, indent=2))
    save(result)


def headline(result: dict) -> str:
    return "p50 added over judging off: " + ", ".join(
        f"{r['judge']} +{r['p50_added_ms']:.0f} ms (think {r['think_ms']} ms)" for r in result["runs"] if r["judge"] != "off")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    thinks = sorted({r["think_ms"] for r in result["runs"]})
    width = 0.25
    for i, judge in enumerate(("off", "remote", "in-process")):
        rows = [next(r for r in result["runs"] if r["judge"] == judge and r["think_ms"] == t) for t in thinks]
        xs = [k + (i - 1) * width for k in range(len(thinks))]
        ax.bar(xs, [r["p50_ms"] for r in rows], width, label=f"judge {judge} p50")
        ax.scatter(xs, [r["p99_ms"] for r in rows], marker="_", s=200, color="black")
    ax.set_xticks(range(len(thinks)), [f"think {t} ms" for t in thinks])
    ax.set_ylabel("chat latency (ms; bar p50, dash p99)")
    ax.set_title(f"Judging beside serving: {result['model']}", fontsize=10)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
