"""Session inference at scale: lookup cost and memory per session as open sessions grow.

    python -m bench.sessions_scale

Opens up to 10,000 sessions across 100 users (each a conversation of a system prompt and a
few turns), then times requests that continue random sessions without any header — the
stock-client case, where nextstate must find the session from the messages alone. The store
is driven directly (no HTTP, no model) so the numbers are the session index's own. Writes
bench/results/sessions_scale.json and a PNG.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc

from bench.report import pyplot, save
from nextstate.core.types import Turn
from nextstate.proxy.sessions import SessionStore

USERS = 100
TURNS = 3


def _turn(plan, messages) -> Turn:
    return Turn(
        session_id=plan.session.id, user=plan.session.user, turn_index=plan.turn_index, messages=messages,
        prompt_ids=[], response_ids=[], response_logprobs=[], logprob_temperature=1.0, sampling={},
        policy_version=0, adapter=None, response_message={}, finish_reason="stop", created_at=0.0,
    )


def conversation(i: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    for t in range(TURNS):
        msgs.append({"role": "user", "content": f"conversation {i}, question {t}: " + "words " * 30})
        msgs.append({"role": "assistant", "content": f"answer {t} to {i}: " + "reply " * 40})
    return msgs


def build(store: SessionStore, n: int, start: int = 0) -> dict[int, list[dict]]:
    """Open sessions start..n-1; each gets TURNS main turns so its line is a real conversation."""
    lines = {}
    for i in range(start, n):
        user = f"user{i % USERS}"
        msgs = conversation(i)
        for t in range(TURNS):
            prompt = msgs[: 2 + 2 * t]
            plan = store.resolve(user, prompt)
            store.commit_main(plan, _turn(plan, prompt), msgs[2 + 2 * t])
        lines[i] = msgs
    return lines


def main() -> None:
    sizes = [100, 500, 1000, 2500, 5000, 10000]
    store = SessionStore(lambda t: None, idle_s=1e9, max_sessions=1_000_000)
    lines: dict[int, list[dict]] = {}
    rng = random.Random(0)
    points = []
    built = 0
    for n in sizes:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        lines.update(build(store, n, built))
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        per_session = (after - before) / (n - built)
        built = n
        timings = []
        for _ in range(2000):
            i = rng.randrange(n)
            request = lines[i] + [{"role": "user", "content": "and another thing"}]
            started = time.perf_counter()
            plan = store.resolve(f"user{i % USERS}", request, turn_type="side")
            timings.append(time.perf_counter() - started)
            assert plan.match == "extend", "every request must find its session"
        points.append({
            "open_sessions": len(store),
            "lookup_us_median": round(1e6 * statistics.median(timings), 1),
            "lookup_us_p99": round(1e6 * sorted(timings)[int(0.99 * len(timings))], 1),
            "index_bytes_per_session": round(per_session),
        })
        print(points[-1], flush=True)
    result = {
        "benchmark": "sessions_scale",
        "users": USERS,
        "messages_per_request": 2 + 2 * TURNS,
        "note": "lookup = hashing the request's messages and probing the index (no HTTP, no model); "
        "bytes per session counts the store's own allocations (the pending Turn is tiny here).",
        "points": points,
    }
    save(result)


def headline(result: dict) -> str:
    first, last = result["points"][0], result["points"][-1]
    return (f"lookup median {first['lookup_us_median']} µs at {first['open_sessions']} sessions, "
            f"{last['lookup_us_median']} µs at {last['open_sessions']}; ~{last['index_bytes_per_session'] / 1000:.1f} KB/session")


def plot(result: dict):
    points = result["points"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p["open_sessions"] for p in points]
    ax.plot(xs, [p["lookup_us_median"] for p in points], "o-", label="median lookup (µs)")
    ax.plot(xs, [p["lookup_us_p99"] for p in points], "s--", label="p99 lookup (µs)")
    ax.set_xscale("log")
    ax.set_xlabel("open sessions (100 users)")
    ax.set_ylabel("µs per request")
    ax.set_ylim(bottom=0)
    ax.set_title("Finding a request's session without headers")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
