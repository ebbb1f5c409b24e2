"""Does the in-process judge slow users down? User first-token latency with the judge idle and busy.

    python -m bench.judge_contention              # SmolLM2 judging itself on this machine's cores
    python -m bench.judge_contention --probes 10  # fewer probe requests per phase

One nextstate serves SmolLM2 and judges with it in-process (NEXTSTATE_JUDGE_BASE_URL unset,
combined mode: 3 PRM votes, 3 hint votes and a teacher pass per turn; calibration and learner
off so that every turn is judged and nothing trains). A probe user sends short fresh chats, one
every `--gap` seconds, as a person would, and the time to the first streamed token is recorded:

* idle — nothing for the judge to do;
* busy — after another user's conversation of `--backlog` corrected turns (each one the
  judge's work) has queued up, while the judge works through it. The report says how many
  turns the judge still had waiting when the probes ended: busy means busy all the way.

Writes bench/results/judge_contention-<model>.json with p50/p99 of both phases.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from bench.models import bench_model, bench_server
from bench.report import percentile, pyplot, save

PROBES = [
    "What is the capital of Italy?", "Name a primary colour.", "How many legs has a spider?",
    "What is 7 times 8?", "Give me a synonym for happy.", "What is the boiling point of water?",
    "Which planet is the largest?", "Say hello in French.", "What day comes after Monday?",
    "Name a fruit that is yellow.",
]


def first_token(client, content: str) -> float:
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


def probe(client, n: int, gap: float, tag: str) -> list[float]:
    out = []
    for i in range(n):
        out.append(first_token(client, f"{PROBES[i % len(PROBES)]} ({tag} {i})"))
        time.sleep(gap)
    return out


def pending(server, admin: str) -> int:
    report = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {admin}"}, timeout=30).json()
    return report["samples"]["transitions_pending"]


def backlog(client, turns: int) -> None:
    messages = [{"role": "user", "content": "Write a two-line poem about the sea."}]
    for turn in range(turns):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0.7)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": f"No, that is not what I asked. Make it rhyme (try {turn + 2})."}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=4)  # the last turn's next state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between a probe's reply and the next")
    parser.add_argument("--backlog", type=int, default=6, help="judged turns queued before the busy phase")
    args = parser.parse_args()

    model_dir = bench_model(model=args.model, smol=True)
    with bench_server(model_dir, judge_calibration=False, learn=False) as server:
        admin = server.key("admin", admin=True)
        user = server.client(server.key("probe"))
        first_token(user, "warm up")
        idle = probe(user, args.probes, args.gap, "idle")
        backlog(server.client(server.key("writer")), args.backlog)
        queued = pending(server, admin)
        busy = probe(user, args.probes, args.gap, "busy")
        left = pending(server, admin)
    result = {
        "benchmark": "judge_contention",
        "model": model_dir.name,
        "probes": args.probes,
        "gap_s": args.gap,
        "backlog_turns": args.backlog,
        "judge_pending_at_start": queued,
        "judge_pending_at_end": left,
        "first_token_ms": {"idle": [1000 * s for s in idle], "busy": [1000 * s for s in busy]},
    }
    for phase in ("idle", "busy"):
        for q in (0.5, 0.99):
            result[f"{phase}_p{int(100 * q)}_ms"] = percentile(result["first_token_ms"][phase], q)
    result["p99_ratio"] = result["busy_p99_ms"] / result["idle_p99_ms"]
    result["p50_ratio"] = result["busy_p50_ms"] / result["idle_p50_ms"]
    print(json.dumps({k: v for k, v in result.items() if k != "first_token_ms"}, indent=2))
    save(result)


def headline(result: dict) -> str:
    return (f"user first token idle p50/p99 {result['idle_p50_ms']:.0f}/{result['idle_p99_ms']:.0f} ms, "
            f"judge busy {result['busy_p50_ms']:.0f}/{result['busy_p99_ms']:.0f} ms "
            f"(p99 x{result['p99_ratio']:.2f}; judge had {result['judge_pending_at_start']} → "
            f"{result['judge_pending_at_end']} turns waiting)")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    data = [result["first_token_ms"]["idle"], result["first_token_ms"]["busy"]]
    ax.boxplot(data, whis=(1, 99))
    ax.set_xticks([1, 2], ["judge idle", "judge busy"])
    ax.set_ylabel("user first token (ms)")
    ax.set_ylim(bottom=0)
    fig.suptitle(f"{result['model']}: in-process judge on the same cores", fontsize=10)
    return fig


if __name__ == "__main__":
    main()
