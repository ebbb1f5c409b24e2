"""A person's day with a real OpenClaw on the README's setup: no lost turn, and the wish shows.

    python -m bench.openclaw_day                       # 20 turns, ratings, versions, held-out questions
    python -m bench.openclaw_day --turns 20 --versions 0   # only the day: does any turn get lost?
    python -m bench.openclaw_day --openclaw-held-out   # also through OpenClaw, base model and newest version

Installs Node and OpenClaw as bench/openclaw_e2e does (a scratch folder, the npm registry; never in
CI), starts `nextstate serve` at every default (the embedded SmolLM2, which judges itself and is
benched by its start-up check: next states teach as hindsight hints) with a user key and an admin
key, and writes the json5 block of docs/agents.md's OpenClaw section, key and port put in, as the
whole `~/.openclaw/openclaw.json`. Then one person's day in one `--session-id`: everyday questions,
one `openclaw agent --local` run each. The person wants short answers: a reply of more than
`WISH_WORDS` words is rated -1 through `POST /v1/feedback` with the correction "Too long. One
sentence please.", a short one +1, and one that is not English at all (`plain_english`) -1 with
"That is not English. One plain sentence please."

Reports:
* lost turns: runs that exited non-zero or brought no reply (the issue's "Preflight compaction
  required but failed" after OpenClaw's summaries failed its own checks) or whose reply the
  token limit stopped under STARVED_TOKENS because OpenClaw asked for no more than it thought the
  context had left (lost, counted apart as `cut_turns`, and not rated), the compaction and
  memory-flush requests OpenClaw sent, and how nextstate filed them (side turns, sessions);
* how fast each rating was answered;
* the wish on `HELD_OUT` questions no rating touched, through the plain API (a second user's key
  for the base model, the person's own for each version as it is published), and with
  `--openclaw-held-out` through OpenClaw too (the base model and the newest version, once every
  rating of the day has trained): the share of replies of at most `WISH_WORDS` words
  and their mean length;
* time from the last rating to each version, and the server's memory peak.

Writes bench/results/openclaw_day-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.models import bench_model
from bench.openclaw_e2e import Nextstate, install, newest_main_turn, read_records, run_turn, tally
from bench.openclaw_readme import readme_config
from bench.report import pyplot, save

WISH_WORDS = 20
CORRECTION = "Too long. One sentence please."
# What the person says to a reply that is not in her language at all (SmolLM2 sampled
# character soup on OpenClaw prompts past ~5k tokens, 2026-12-07): few spaces made it "short"
GIBBERISH_CORRECTION = "That is not English. One plain sentence please."
# A reply stopped by the token limit this short was starved: OpenClaw asked for what it thought
# was left of the context window (bench.openclaw_window counts the same way)
STARVED_TOKENS = 64
DAY = [
    "Good morning! What is a quick healthy breakfast I can make?",
    "How long should I boil an egg for a soft yolk?",
    "What is the weather usually like in Lisbon in spring?",
    "Can you suggest a name for my new goldfish?",
    "How do I remove a coffee stain from a white shirt?",
    "What is a good stretch for a stiff neck?",
    "Give me an idea for a quick lunch at my desk.",
    "How many cups are in a litre?",
    "What should I say in an email to reschedule a meeting?",
    "Why do cats purr?",
    "How do I keep basil alive on a windowsill?",
    "What is a polite way to ask a neighbour to turn the music down?",
    "Suggest a short walk I could take after work.",
    "How do I convert 30 degrees Celsius to Fahrenheit?",
    "What is a good book to read on a train?",
    "How can I fall asleep faster tonight?",
    "What is the difference between baking soda and baking powder?",
    "Give me a tip for remembering where I left my keys.",
    "What can I cook with rice, eggs and spinach?",
    "Thanks for today. What is one thing I could plan for tomorrow?",
]
HELD_OUT = [
    "What is a good houseplant for a dark room?",
    "How do I make my tea less bitter?",
    "What is a fun thing to do on a Sunday morning?",
    "How should I store fresh bread?",
    "What is a quick way to tidy a messy desk?",
    "Why is the sky blue?",
    "How do I politely end a long phone call?",
    "What should I pack for a day at the beach?",
    "How often should I water a cactus?",
    "What is a good warm-up before running?",
    "How do I get rid of hiccups?",
    "Suggest a gift for a friend who likes gardening.",
]


def words(text: str) -> int:
    return len(text.split())


def plain_english(text: str) -> bool:
    """Whether the reply's letters are, nine in ten at least, the Latin alphabet's."""
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= 0.9 * len(letters)


def meets_wish(text: str) -> bool:
    return 0 < words(text) <= WISH_WORDS and plain_english(text)


def day_config(port: int, key: str) -> str:
    """The README's file, word for word but for the key and the port."""
    return readme_config(key, port)


def rate(server: Nextstate, data: Path, key: str, seen: str | None) -> dict:
    """The person's rating of the turn just run: -1 with the correction if it was too long. The
    reply is read whole from nextstate's record (OpenClaw's --json output is cut at 500 characters)."""
    turn = newest_main_turn(data)
    if turn is None or turn["id"] == seen:
        return {"status": "no new reply to rate"}
    reply = (turn["response"] or {}).get("content") or ""
    if turn.get("finish_reason") == "length" and (turn.get("usage") or {}).get("completion_tokens", 0) < STARVED_TOKENS:
        # OpenClaw asked for as many tokens as it thought were left in the context window: a
        # reply cut at a word or two is a turn the person lost, not a short answer to reward (a
        # 512-token reply of few spaces is not: words alone told them apart wrongly)
        return {"response_id": turn["id"], "status": "cut", "words": words(reply)}
    rating = 1 if meets_wish(reply) else -1
    correction = CORRECTION if plain_english(reply) else GIBBERISH_CORRECTION
    body = {"response_id": turn["id"], "rating": rating, **({} if rating > 0 else {"correction": correction})}
    started = time.monotonic()
    answer = httpx.post(f"{server.root}/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return {"response_id": turn["id"], "rating": rating, "status": answer.json().get("status", answer.text[:200]),
            "answered_s": round(time.monotonic() - started, 3), "words": words(reply)}


def ask_plain(server: Nextstate, key: str, model: str, questions: list[str], max_tokens: int) -> dict:
    """The questions through the plain Chat Completions API, one fresh conversation each."""
    replies, versions = [], set()
    for question in questions:
        answer = httpx.post(f"{server.root}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                            json={"model": model, "messages": [{"role": "user", "content": question}],
                                  "max_tokens": max_tokens, "seed": 7})
        answer.raise_for_status()
        versions.add(answer.headers.get("x-policy-version"))
        replies.append(answer.json()["choices"][0]["message"]["content"] or "")
    return summary(replies) | {"served_by": sorted(v for v in versions if v is not None)}


def ask_openclaw(openclaw: Path, env: dict, questions: list[str], tag: str, timeout_s: int) -> dict:
    """The questions through OpenClaw, one fresh `--session-id` each."""
    runs = [run_turn(openclaw, env, q, f"held-{tag}-{i}", timeout_s) for i, q in enumerate(questions)]
    return summary([r["reply"] if not r["exit"] else "" for r in runs]) | {"failed": sum(1 for r in runs if r["exit"])}


def summary(replies: list[str]) -> dict:
    return {"meets_wish": sum(map(meets_wish, replies)), "asked": len(replies),
            "mean_words": round(statistics.fmean(map(words, replies)), 1) if replies else None,
            "replies": [r[:300] for r in replies]}


def ready_samples(data: Path) -> int:
    """Samples waiting for an update (nextstate's own store, read as the tally does)."""
    with sqlite3.connect(data / "samples.sqlite3") as db:
        return int(db.execute("SELECT COUNT(*) FROM samples WHERE status = 'ready'").fetchone()[0])


def published_versions(server: Nextstate, admin: str) -> tuple[list[dict], dict]:
    report = httpx.get(f"{server.root}/v1/admin/progress", headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
    return [s for s in report.get("steps", []) if s.get("published")], report


def home_for(work: Path, name: str, port: int, key: str, env: dict) -> dict:
    """A fresh OpenClaw home holding the README's file for `key`."""
    home = work / name
    shutil.rmtree(home, ignore_errors=True)
    (home / ".openclaw" / "workspace").mkdir(parents=True)
    (home / ".openclaw" / "openclaw.json").write_text(day_config(port, key))
    return {**env, "HOME": str(home)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=len(DAY))
    parser.add_argument("--versions", type=int, default=4,
                        help="at most this many versions evaluated, each as it is published, until every rating of the "
                             "day has trained (0: none)")
    parser.add_argument("--train-timeout", type=int, default=5400, help="seconds to wait for those versions")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per OpenClaw turn")
    parser.add_argument("--max-tokens", type=int, default=512, help="the plain API's reply limit (the README's maxTokens)")
    parser.add_argument("--openclaw-held-out", action="store_true", help="ask the held-out questions through OpenClaw too")
    parser.add_argument("--variant", help="the result's name (default: openclaw_day-<model>.json)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "nextstate-openclaw-e2e",
                        help="scratch folder (Node and OpenClaw are kept there between runs)")
    args = parser.parse_args()

    model_dir = bench_model(None, smol=True)
    args.work.mkdir(parents=True, exist_ok=True)
    openclaw, env = install(args.work)
    data = args.work / "day-data"
    shutil.rmtree(data, ignore_errors=True)
    server = Nextstate(data, None, None, args.work / "day-nextstate.log")  # every default: the embedded model
    key, base_key, admin = server.key("dana"), server.key("base-probe"), server.key("admin", admin=True)
    server.start()
    person = home_for(args.work, "day-home", server.port, key, env)
    result: dict = {"benchmark": "openclaw_day", "model": model_dir.name, "openclaw": "openclaw@2026.9.6",
                    "wish": f"at most {WISH_WORDS} words (correction: {CORRECTION!r})", "config": day_config(server.port, "ns-..."),
                    "variant": args.variant}
    evaluations = []
    try:
        print("held-out questions, base model", flush=True)
        evaluations.append({"version": 0, "plain": ask_plain(server, base_key, model_dir.name, HELD_OUT, args.max_tokens)})
        if args.openclaw_held_out:
            base_home = home_for(args.work, "day-home-base", server.port, base_key, env)
            evaluations[-1]["openclaw"] = ask_openclaw(openclaw, base_home, HELD_OUT, "v0", args.timeout)
        turns, seen = [], None
        for i, message in enumerate(DAY[: args.turns], 1):
            turn = run_turn(openclaw, person, message, "dana-day", args.timeout)
            lost = bool(turn["exit"]) or not turn["reply"].strip()
            turn["lost"] = lost
            if not lost:
                turn["rating"] = rate(server, data, key, seen)
                seen = turn["rating"].get("response_id", seen)
                turn["words"] = turn["rating"].get("words")
                turn["lost"] = turn["cut"] = turn["rating"]["status"] == "cut"
            turns.append(turn)
            told = "LOST" if lost else f"CUT at {turn['words']} words" if turn["cut"] else f"{turn['words']} words"
            print(f"turn {i}: {turn['seconds']} s, {told}, "
                  f"rating {turn.get('rating', {}).get('rating')} ({turn.get('rating', {}).get('answered_s')} s): "
                  f"{turn['reply'][:80]!r}", flush=True)
        last_rating = time.monotonic()
        result["turns"] = turns
        result["lost_turns"] = sum(t["lost"] for t in turns)
        result["cut_turns"] = sum(bool(t.get("cut")) for t in turns)
        started, evaluated, idle_since = time.monotonic(), set(), None
        while len(evaluated) < args.versions and time.monotonic() - started < args.train_timeout:
            steps, report = published_versions(server, admin)
            for step in steps:
                version = step.get("version")
                if version in evaluated or len(evaluated) >= args.versions:
                    continue
                evaluated.add(version)
                waited = round(time.monotonic() - last_rating)
                print(f"v{version} published {waited} s after the last rating; held-out questions", flush=True)
                evaluations.append({"version": version, "seconds_after_last_rating": waited, "samples": step.get("samples"),
                                    "plain": ask_plain(server, key, model_dir.name, HELD_OUT, args.max_tokens)})
            # the day's every rating trained: nothing ready, no update running, twice a minute apart
            idle = not report.get("training") and ready_samples(data) == 0
            idle_since = (idle_since or time.monotonic()) if idle else None
            if evaluated and idle_since and time.monotonic() - idle_since >= 60:
                break
            time.sleep(15)
        if args.openclaw_held_out and len(evaluations) > 1:  # the newest version, the one the person has now
            print(f"v{evaluations[-1]['version']}: held-out questions through OpenClaw", flush=True)
            evaluations[-1]["openclaw"] = ask_openclaw(openclaw, person, HELD_OUT, f"v{evaluations[-1]['version']}", args.timeout)
        result["waiting_at_end"] = report.get("waiting") if args.versions else None
        result["memory_mb"] = server.memory_mb()
    finally:
        server.stop()
    result["evaluations"] = evaluations
    result.update(tally(data))
    result["first_version_after_4th_rating_s"] = first_version_wait(data)
    print(json.dumps({k: v for k, v in result.items() if k not in ("turns", "config")}, indent=1)[:6000])
    save(result)


def first_version_wait(data: Path) -> float | None:
    """Seconds from the day's fourth rating to the first version published, from the records
    (None if no version came)."""
    records = read_records(data)
    rated = sorted(r["ts"] for r in records if r["kind"] == "feedback")
    published = sorted(r["ts"] for r in records if r["kind"] == "train_step" and r.get("published"))
    return round(published[0] - rated[3], 1) if len(rated) >= 4 and published else None


def headline(result: dict) -> str:
    def through_openclaw(e: dict) -> str:
        o = e.get("openclaw")
        return f", through OpenClaw {o['meets_wish']}/{o['asked']} ({o['mean_words']} words)" if o else ""

    evaluation = "; ".join(f"v{e['version']}: {e['plain']['meets_wish']}/{e['plain']['asked']} short "
                           f"({e['plain']['mean_words']} words){through_openclaw(e)}" for e in result.get("evaluations", []))
    turns = sorted(t["seconds"] for t in result["turns"] if not t["lost"])
    pace = f" (median {statistics.median(turns):.0f} s)" if turns else ""
    first = result.get("first_version_after_4th_rating_s")
    version = f"; v1 {first / 60:.1f} min after the 4th rating" if first is not None else ""
    return (f"{len(result['turns'])} OpenClaw turns{pace}, {result['lost_turns']} lost; {result['main_turns']} main turns in "
            f"{result['sessions']} session(s), {result['side_turns']} side turns{version}; held-out questions: {evaluation}")


def plot(result: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    turns = result["turns"]
    ax.bar(range(1, len(turns) + 1), [t["seconds"] for t in turns], color=["C3" if t["lost"] else "C0" for t in turns])
    ax.set_xlabel("turn of the day (red: lost)")
    ax.set_ylabel("seconds (openclaw agent --local)")
    ax.set_title(f"A day with OpenClaw 2026.9.6 on nextstate — {result['model']}, CPU")
    return fig


if __name__ == "__main__":
    main()
