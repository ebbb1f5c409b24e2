"""Does the README's OpenClaw file keep a long day inside an 8k context? Minutes, no model.

    python -m bench.openclaw_window                    # the README's file, 20 turns
    python -m bench.openclaw_window --variant 8kb --compaction '{ qualityGuard: { enabled: false },
        timeoutSeconds: 900, memoryFlush: { enabled: false }, maxActiveTranscriptBytes: "8kb",
        keepRecentTokens: 600, recentTurnsPreserve: 1 }'       # another compaction block
    python -m bench.openclaw_window --short-summaries      # summaries of a few lines

A real day on SmolLM2 takes an hour and a half of two cores (bench.openclaw_day); whether
OpenClaw compacts in time is a question of its config and of how long the replies are, not of
the model — or so it seemed. Here a stand-in server answers as the worst case of SmolLM2 does:
every main turn and every summary a reply of the full limit OpenClaw asks for (512 tokens for a
turn), or with `--short-summaries` a few lines with the headings OpenClaw wants; prompt sizes are counted with the embedded model's tokenizer
and chat template and refused past 8192 as nextstate refuses them. The same 20 questions as the
day run, one `openclaw agent --local` each in one `--session-id`.

What it found (BENCHMARKS.md): with OpenClaw's own keep settings (20k tokens, three turns copied
into the summary) a day starved from turn 11 (a reply limit of 1 token, as the last turns of two
real days did); `keepRecentTokens: 1000, recentTurnsPreserve: 0`, the README's file since, kept
every one of 20 turns at 512 tokens, and a real day with it lost no turn. An 8 kB compaction
trigger passed here and starved a real day: the stand-in is a quick first check of a file, not
the proof.

Reports, per turn, the prompt tokens, the reply limit OpenClaw asked for and the summary requests
so far. Writes bench/results/openclaw_window-<model>[-<variant>].json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.models import bench_model
from bench.openclaw_day import DAY, STARVED_TOKENS
from bench.openclaw_e2e import install, run_turn
from bench.openclaw_readme import readme_config
from bench.report import pyplot, save
from tests.background_server import free_port

CONTEXT = 8192
MODEL_ID = "SmolLM2-135M-Instruct"  # what the README's file asks for
LONG_REPLY = "Here is a long answer that goes on about many things, with lists and details. " * 60
SUMMARY = "## Decisions\nnone\n## Open TODOs\nnone\n## Constraints/Rules\nnone\n## Pending user asks\nnone\n## Exact identifiers\nnone"


def stand_in(tokenizer, calls: list[dict], short_summaries: bool) -> FastAPI:
    """The worst case of a small model behind nextstate: every reply as long as allowed."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "max_model_len": CONTEXT}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()

        def text(message: dict) -> str:
            content = message.get("content") or ""
            return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content if isinstance(p, dict))

        messages = [{"role": m["role"] if m["role"] in ("system", "user", "assistant") else "user", "content": text(m)}
                    for m in body["messages"]]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the tools as JSON: SmolLM2's template has no place for them, nextstate writes them into the prompt
        rendered += json.dumps(body.get("tools") or [])
        prompt = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        summary = "summarization assistant" in messages[0]["content"]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 512
        if prompt + limit > CONTEXT:
            calls.append({"kind": "refused", "prompt": prompt, "max_tokens": limit})
            return JSONResponse(status_code=400, content={"error": {
                "message": f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                           f"{prompt + limit} tokens", "type": "invalid_request_error", "code": "context_length_exceeded"}})
        # a summary as long as allowed too, as SmolLM2's are (256-409 tokens, at OpenClaw's limit,
        # on the real days); with `--short-summaries` the one a capable model writes
        ids = tokenizer(SUMMARY if summary and short_summaries else LONG_REPLY)["input_ids"]
        finish = "length" if len(ids) > limit else "stop"
        reply = tokenizer.decode(ids[:limit])
        calls.append({"kind": "summary" if summary else "main", "prompt": prompt, "max_tokens": limit,
                      "messages": len(messages), "finish": finish})
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body["model"]}
        usage = {"prompt_tokens": prompt, "completion_tokens": min(len(ids), limit), "total_tokens": prompt + min(len(ids), limit)}
        if not body.get("stream"):
            return head | {"object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}]}
        chunk = head | {"object": "chat.completion.chunk"}
        events = [chunk | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": reply}, "finish_reason": None}]},
                  chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                  chunk | {"choices": [], "usage": usage}]
        return StreamingResponse(iter([f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    return app


def with_compaction(config: str, block: str | None) -> str:
    """The README's file with its compaction block replaced by `block` (a json5 object)."""
    if not block:
        return config
    start = config.index("compaction: {") + len("compaction: ")
    depth, end = 0, start
    for end, ch in enumerate(config[start:], start):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            break
    return config[:start] + block + config[end + 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=len(DAY))
    parser.add_argument("--compaction", help="a json5 object in place of the README's compaction block")
    parser.add_argument("--variant", help="the result's name for that block (default: the README's file)")
    parser.add_argument("--short-summaries", action="store_true",
                        help="summaries of a few lines, as a capable model writes (default: as long as OpenClaw allows)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nextstate-openclaw-e2e",
                        help="scratch folder (Node and OpenClaw are kept there between runs)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bench_model(None, smol=True))
    openclaw, env = install(args.work)
    calls: list[dict] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stand_in(tokenizer, calls, args.short_summaries), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    home = args.work / f"window-home-{args.variant or 'readme'}"  # variants may run side by side
    shutil.rmtree(home, ignore_errors=True)
    (home / ".openclaw" / "workspace").mkdir(parents=True)
    config = with_compaction(readme_config("ns-stand-in", port), args.compaction)
    (home / ".openclaw" / "openclaw.json").write_text(config)
    turns = []
    try:
        for i, message in enumerate(DAY[: args.turns], 1):
            turn = run_turn(openclaw, {**env, "HOME": str(home)}, message, "window-day", 600)
            main_call = next((c for c in reversed(calls) if c["kind"] == "main"), {})
            turns.append({"turn": i, "seconds": turn["seconds"], "exit": turn["exit"], "prompt": main_call.get("prompt"),
                          "max_tokens": main_call.get("max_tokens"), "summaries": sum(c["kind"] == "summary" for c in calls),
                          "refused": sum(c["kind"] == "refused" for c in calls)})
            print(json.dumps(turns[-1]), flush=True)
    finally:
        server.should_exit = True
    starved = [t["turn"] for t in turns if t["exit"] or (t["max_tokens"] or 0) < STARVED_TOKENS]
    variant = "-".join(filter(None, [args.variant if args.compaction else None, "short-summaries" if args.short_summaries else None]))
    save({"benchmark": "openclaw_window", "model": MODEL_ID, "variant": variant or None, "short_summaries": args.short_summaries,
          "openclaw": "openclaw@2026.9.6", "compaction": args.compaction, "config": config.replace(str(port), "PORT"),
          "turns": turns, "starved_turns": starved, "summary_requests": sum(c["kind"] == "summary" for c in calls),
          "largest_prompt": max((c["prompt"] for c in calls if c["kind"] == "main"), default=None)})


def headline(result: dict) -> str:
    starved = result["starved_turns"]
    what = f"turns {starved[0]}-{starved[-1]} starved (reply limit < {STARVED_TOKENS} tokens)" if starved else "no turn starved"
    how = result.get("variant") or "README file"
    return (f"{len(result['turns'])} OpenClaw turns of 512-token replies in an 8k window ({how}): {what}; "
            f"largest prompt {result['largest_prompt']} tokens, {result['summary_requests']} summary requests")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    turns = [t["turn"] for t in result["turns"]]
    ax.plot(turns, [t["prompt"] for t in result["turns"]], marker="o", label="prompt tokens")
    ax.plot(turns, [t["max_tokens"] for t in result["turns"]], marker="s", label="reply limit OpenClaw asked")
    ax.axhline(CONTEXT, color="C3", lw=0.8, ls="--", label="context")
    ax.set_xlabel("turn of the day")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.set_title("OpenClaw 2026.9.6 in an 8k window, replies at their limit")
    return fig


if __name__ == "__main__":
    main()
