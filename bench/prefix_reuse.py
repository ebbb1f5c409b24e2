"""First-token latency of an agent conversation, with the KV cache of earlier turns reused and without.

    python -m bench.prefix_reuse                  # SmolLM2 on this machine, 10 turns
    python -m bench.prefix_reuse --turns 4        # shorter
    python -m bench.prefix_reuse --tiny           # the tiny test model (a smoke run)

The conversation is OpenClaw's: the trimmed agent setup of shared/fixtures/openclaw-2026.9.6
(its 8,971-character system prompt and 5 tools, ~3.8k tokens once rendered), its first user
message, then follow-ups in OpenClaw's format ("[Mon 2026-11-23 09:25 UTC] ..."). Each turn is
sent the way OpenClaw sends it (stream, include_usage, tools, tool_choice auto) with the stock
openai client; the reply, tool calls included, goes into the next request with a tool result
for every call, so every request is the last one plus a few new messages.

Two servers run the same conversation one after the other, greedy, judge and learner off:
`NEXTSTATE_KV_CACHE_MB` at its default, and 0 (every request prefilled in full). First token
= the first chunk with content or a tool call. Writes bench/results/prefix_reuse-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.models import bench_model, bench_server
from bench.report import ROOT, pyplot, save

FIXTURE = ROOT / "tests" / "data" / "openclaw-2026.9.6" / "traffic.jsonl"  # shared/fixtures/…, as captured
TRIMMED_SYSTEM_CHARS = 8971
FOLLOW_UPS = [
    "Use the read tool to read the file notes.txt and tell me the secret word.",
    "No, that is wrong, answer in one sentence.",
    "Thanks. Now list the files in the workspace.",
    "Run `date` with the exec tool.",
    "What did the last command print?",
    "Write a one-line summary of notes.txt.",
    "Which of the files is the largest?",
    "Thanks, that helps. Anything else I should know?",
    "Good night.",
]


def openclaw_start() -> tuple[list[dict], list[dict]]:
    """The trimmed setup's first request: [system, user] and its tools."""
    for line in FIXTURE.read_text().splitlines():
        row = json.loads(line)
        body = row.get("req_body")
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except json.JSONDecodeError:
                continue
        if not isinstance(body, dict) or "messages" not in body:
            continue
        messages = body["messages"]
        if len(messages) == 2 and len(messages[0]["content"]) == TRIMMED_SYSTEM_CHARS:
            return messages, body["tools"]
    raise SystemExit(f"no trimmed OpenClaw request in {FIXTURE}")


def openclaw_follow_up(turn: int) -> dict:
    """The user's message of `turn` (1 on), timestamped as OpenClaw does."""
    minute = 25 + 4 * turn
    return {"role": "user", "content": f"[Mon 2026-11-23 {9 + minute // 60:02d}:{minute % 60:02d} UTC] "
                                       f"{FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}"}


def converse(client, model: str, turns: int, max_tokens: int) -> list[dict]:
    messages, tools = openclaw_start()
    out = []
    for turn in range(turns):
        if turn:
            messages.append(openclaw_follow_up(turn))
        started = time.perf_counter()
        first, content, calls, usage = None, "", {}, None
        stream = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="auto", stream=True,
            stream_options={"include_usage": True}, max_tokens=max_tokens, temperature=0,
        )
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if first is None and (delta.content or delta.tool_calls):
                first = time.perf_counter() - started
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                entry["id"] = call.id or entry["id"]
                if call.function:
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
        total = time.perf_counter() - started
        reply = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(reply)
        for call in reply.get("tool_calls", []):
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "(done; no output)"})
        row = {"turn": turn + 1, "first_token_s": first if first is not None else total, "total_s": total,
               "prompt_tokens": usage.prompt_tokens if usage else None, "tool_calls": len(calls)}
        print(json.dumps(row))
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="use the tiny test model")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    model_dir = bench_model(model=args.model, smol=not args.tiny)
    runs = {}
    for mode, mb in (("reuse", None), ("full_prefill", 0)):
        overrides = {"judge_enabled": False, "learn": False}
        if mb is not None:
            overrides["kv_cache_mb"] = mb
        print(f"-- {mode}")
        with bench_server(model_dir, **overrides) as server:
            runs[mode] = converse(server.client(server.key("bench")), "m", args.turns, args.max_tokens)
    later = slice(1, None)
    ratio = [r["first_token_s"] / f["first_token_s"] for r, f in zip(runs["reuse"][later], runs["full_prefill"][later])]
    result = {
        "benchmark": "prefix_reuse",
        "model": model_dir.name,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "later_turns_ratio_median": statistics.median(ratio),
        "later_turns_ratio_max": max(ratio),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    save(result)


def headline(result: dict) -> str:
    reuse, full = result["runs"]["reuse"], result["runs"]["full_prefill"]
    return (f"{full[0]['prompt_tokens']}-{full[-1]['prompt_tokens']} prompt tokens; first token, turns 2-{result['turns']}: "
            f"{statistics.median(r['first_token_s'] for r in reuse[1:]):.2f} s with reuse vs "
            f"{statistics.median(r['first_token_s'] for r in full[1:]):.1f} s full prefill (median); "
            f"ratio median {result['later_turns_ratio_median']:.2f}, worst {result['later_turns_ratio_max']:.2f}")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, color, label in (("full_prefill", "tab:gray", "full prefill"), ("reuse", "tab:blue", "KV cache reused")):
        rows = result["runs"][mode]
        ax.plot([r["turn"] for r in rows], [r["first_token_s"] for r in rows], "o-", color=color, label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("first token (s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.suptitle(f"{result['model']}: OpenClaw's trimmed agent prompt, {result['turns']} turns", fontsize=10)
    return fig


if __name__ == "__main__":
    main()
