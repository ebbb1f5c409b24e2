"""What a person on a laptop waits for: an agent's turns, and the version their ratings make.

    python -m bench.agent_pace                       # SmolLM2 at every default
    python -m bench.agent_pace --set learner_dtype=bfloat16 --variant bf16   # a lever on

nextstate at its defaults (judge, learner and gate as they ship) serves four turns of an
OpenClaw-size conversation — OpenClaw's real system prompt and tools (the trimmed setup of
shared/fixtures/openclaw-2026.9.6, ~3.8k tokens rendered) and its follow-ups — sent as OpenClaw
sends them (streamed, tools, `tool_choice` auto) with a reply limit of `--max-tokens`. Each reply
is rated −1 with a correction as soon as it ends, the way a person teaches it ("Answer in one
short sentence."), and the next message follows `--think-s` later (0: at once, the hardest case:
what the learner reads ahead while a batch fills gets only the gaps between turns). Then the
learner's progress is read every two seconds until a version is
published: the time from the fourth rating to it, and how long each phase of the update took
(scoring the serving version for the gate, training, the gate), from the live progress report.
`--pause-s` after the version (20 s) the person writes again: that turn, the new version's first,
is timed too, with how much of its prompt the engine had read already.

The issue's targets (76): each turn's 256 tokens in at most 10 s, a version within 3 minutes of
the fourth rating. `--set FIELD=VALUE` (a Settings field, repeatable) turns a lever on for one
run; compare runs with and without it on the same machine, nothing else running.
Writes bench/results/agent_pace-<model>[-<variant>].json.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from bench.models import bench_model, bench_server
from bench.prefix_reuse import openclaw_follow_up, openclaw_start
from bench.report import pyplot, save

CORRECTION = "Answer in one short sentence."
TURNS = 4
POLL_S = 2.0


def parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def turn(client, messages: list[dict], tools: list[dict], max_tokens: int) -> tuple[dict, dict]:
    """One streamed request as OpenClaw sends it: the reply message and the turn's figures."""
    started = time.perf_counter()
    first = reply_id = usage = None
    content, calls = "", {}
    stream = client.chat.completions.create(
        model="m", messages=messages, tools=tools, tool_choice="auto", stream=True,
        stream_options={"include_usage": True}, max_tokens=max_tokens,
    )
    for chunk in stream:
        reply_id = reply_id or chunk.id
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
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None) if usage else None
    return reply, {"id": reply_id, "total_s": round(total, 2), "first_token_s": round(first or total, 2),
                   "prompt_tokens": usage.prompt_tokens if usage else None,
                   "completion_tokens": usage.completion_tokens if usage else None, "cached_tokens": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model dir (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--wait-s", type=float, default=1800, help="longest wait for a version after the 4th rating")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a Settings field for this run")
    parser.add_argument("--variant", help="a name for this run's result file (with --set)")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="seconds the person takes after rating a reply before writing again (0: at once)")
    parser.add_argument("--pause-s", type=float, default=20.0,
                        help="seconds between the version and the person's next turn, which is timed too")
    args = parser.parse_args()
    overrides = {k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)}

    model_dir = bench_model(model=args.model, smol=not args.model)
    with bench_server(model_dir, **overrides) as server:
        key, admin = server.key("alice"), server.key("admin", admin=True)
        client = server.client(key).with_options(timeout=600)
        messages, tools = openclaw_start()
        turns = []
        rated_at = 0.0
        for i in range(TURNS):
            if i:
                time.sleep(args.think_s)
                messages.append(openclaw_follow_up(i))
            reply, row = turn(client, messages, tools, args.max_tokens)
            messages.append(reply)
            for call in reply.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "(done; no output)"})
            answer = httpx.post(f"{server.base_url}/feedback", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                                json={"response_id": row["id"], "rating": -1, "correction": CORRECTION})
            rated_at = time.monotonic()
            row["rating"] = answer.json().get("status")
            print(json.dumps(row), flush=True)
            turns.append(row)
        # the last reply's next state: the conversation goes on, as a person's would
        messages.append(openclaw_follow_up(TURNS))
        phases: list[dict] = []
        version_s = step = None
        while time.monotonic() - rated_at < args.wait_s:
            report = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {admin}"},
                               timeout=60).json()
            training = report.get("training") or {}
            phase = training.get("phase")
            if phase and (not phases or phases[-1]["phase"] != phase):
                phases.append({"phase": phase, "at_s": round(time.monotonic() - rated_at, 1)})
                print(json.dumps(phases[-1]), flush=True)
            published = [s for s in report.get("steps", []) if s.get("published")]
            if published:
                version_s, step = round(time.monotonic() - rated_at, 1), published[0]
                break
            time.sleep(POLL_S)
        after = None
        if version_s is not None:  # the person writes again a little later, to the new version
            time.sleep(args.pause_s)
            _, after = turn(client, messages, tools, args.max_tokens)
            print(json.dumps({"turn after the version": after}), flush=True)
    result = {"benchmark": "agent_pace", "model": model_dir.name, "variant": args.variant, "settings": overrides,
              "max_tokens": args.max_tokens, "think_s": args.think_s, "turns": turns, "version_after_rating_s": version_s,
              "phases": phases, "step": step, "after_version": after, "pause_s": args.pause_s}
    print(headline(result))
    save(result)


def headline(result: dict) -> str:
    turns = ", ".join(f"{t['total_s']:.1f}" for t in result["turns"])
    version = (f"a version {result['version_after_rating_s'] / 60:.1f} min after the 4th rating"
               if result["version_after_rating_s"] is not None else "no version within the wait")
    if after := result.get("after_version"):
        version += f"; the turn after it {after['total_s']:.1f} s ({after['cached_tokens']} of {after['prompt_tokens']} tokens cached)"
    return f"turns of {result['max_tokens']} tokens at most: {turns} s; {version}"


def plot(result: dict):
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    left.bar([f"turn {i + 1}" for i in range(len(result["turns"]))], [t["total_s"] for t in result["turns"]])
    left.axhline(10, color="tab:red", linestyle="--", label="target 10 s")
    left.set_ylabel("seconds")
    left.legend()
    phases = result["phases"]
    end = result["version_after_rating_s"] or (phases[-1]["at_s"] if phases else 0)
    for i, p in enumerate(phases):
        stop = phases[i + 1]["at_s"] if i + 1 < len(phases) else end
        right.barh(0, stop - p["at_s"], left=p["at_s"], label=p["phase"])
    right.axvline(180, color="tab:red", linestyle="--", label="target 3 min")
    right.set_xlabel("seconds after the 4th rating")
    right.set_yticks([])
    right.legend(fontsize=7)
    figure.suptitle(f"{result['model']} {result.get('variant') or 'defaults'}: {headline(result)}", fontsize=9)
    return figure


if __name__ == "__main__":
    main()
