"""What a version shows at the end of a run: the final evaluation's sampled replies to the asked
and the held-out questions, their surprise to the base model, and perplexity on held-out prose."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from pathlib import Path

from nextstate.engine.base import SamplingParams
from nextstate.learner.readings import repetition, split_words

from bench.models import bench_model, bench_server
from bench.personalization.person import QUESTIONS, TASKS, questions_of
from bench.reply_surprise import REFERENCE_REPLIES, SENSIBLE_SURPRISE, reading, surprise
from bench.report import render

FINAL_SEED = 1_000_003  # the final evaluation's seeds: the same for every run, whatever --seed


async def sampled_replies(turns, adapter, messages: list[dict], seeds: list[int], max_tokens: int,
                           temperature: float) -> list[str]:
    """One reply per seed to `messages`, from the engine directly: what the chat API would
    have answered, without a session, a record, or anything the judge or learner would see."""
    prompt = (await asyncio.to_thread(turns.renderer.render, messages)).ids
    stops = turns.renderer.stop_token_ids

    async def one(seed: int) -> str:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=stops)
        ids = []
        async for token in turns.engine.generate(prompt, params, adapter):
            if token.token_id in stops:
                break
            ids.append(token.token_id)
        return turns.renderer.tokenizer.decode(ids, skip_special_tokens=True)

    return list(await asyncio.gather(*(one(seed) for seed in seeds)))


async def sampled_for_each(turns, adapter, tasks: list[str], n: int, max_tokens: int,
                            temperature: float) -> list[list[str]]:
    """`n` replies to each of `tasks` on the final evaluation's seeds, all submitted at once: the
    engine decodes them in batches of NEXTSTATE_MAX_CONCURRENT_GENERATIONS instead of `n` at a
    time (a version's held-out reading, 48 replies, took minutes question by question)."""
    return list(await asyncio.gather(*(
        sampled_replies(turns, adapter, [{"role": "user", "content": task}], final_seeds(index, n, tasks),
                         max_tokens, temperature)
        for index, task in enumerate(tasks))))


def reading_timeout_s(replies: int) -> float:
    """How long a reading of `replies` sampled replies may take before the run gives up: all are
    one call now, and on two busy cores a batch of eight took over a minute (beside two runs)."""
    return 600.0 + 20.0 * replies


def sampled_texts(server, adapter: str | None, tasks: list[str], n: int, max_tokens: int,
                  temperature: float) -> list[list[str]]:
    """sampled_for_each() from the bench's thread, with a time limit that grows with the replies."""
    return server.call(sampled_for_each(server.app.state.services.turns, adapter, tasks, n, max_tokens, temperature),
                       timeout=reading_timeout_s(n * len(tasks)))


def final_seeds(index: int, n: int, tasks: list[str] = TASKS) -> list[int]:
    """The final evaluation's seeds for tasks[index]: the same for every run and version, each
    list of QUESTIONS following on from the one before, so no question shares another's draws."""
    offset = 0
    for questions in (q for set_ in QUESTIONS.values() for q in (set_.asked, set_.held_out)):
        if questions is tasks:
            break
        offset += len(questions)
    return [FINAL_SEED + 1_009 * (offset + index) + k for k in range(n)]


def sampled_and_scored(server, adapter: str | None, tasks: list[str], n: int, args, scorer,
                       texts: list[list[str]] | None = None) -> list[dict]:
    """`n` replies to each of `tasks` from the version `adapter` (None: the base model) on the
    final evaluation's seeds, each scored against the wish (`texts`: those replies, sampled already)."""
    each = texts if texts is not None else sampled_texts(server, adapter, tasks, n, args.max_tokens, args.temperature)
    return [{"task_index": index, "first_reply": text, "score": scorer.score(task, text)}
            for index, (task, texts) in enumerate(zip(tasks, each)) for text in texts]


def held_out_reading(server, adapter: str | None, n: int, args, scorer,
                     reference: dict[str, list[list[float]]], texts: list[list[str]] | None = None) -> dict:
    """What the version shows of the wish on questions it was never corrected on: the share of
    `n` replies to each held-out question that fit, and that fit and read as sense (`reference`:
    the base model's readings of its own replies to them), with the replies themselves."""
    held_out = questions_of(args).held_out
    replies = sampled_and_scored(server, adapter, held_out, n, args, scorer, texts)
    scores = [r["score"] for r in replies]
    return {"score": round(statistics.fmean(scores), 3), "score_stderr": standard_error(scores),
            **replies_surprise(server, replies, reference, held_out), "replies": len(replies), "samples": replies}


def reference_readings(server, max_tokens: int, temperature: float, tasks: list[str] = TASKS,
                       texts: list[list[str]] | None = None) -> dict[str, list[list[float]]]:
    """The base model's readings of its own replies to each of `tasks`, on the final
    evaluation's first seeds: what bench/reply_surprise.py compares a version's replies with
    (`texts`: those replies, sampled already)."""
    each = texts if texts is not None else sampled_texts(server, None, tasks, REFERENCE_REPLIES, max_tokens, temperature)
    return {task: [reading(server, task, text) for text in own] for task, own in zip(tasks, each)}


def replies_surprise(server, replies: list[dict], reference: dict[str, list[list[float]]],
                     tasks: list[str] = TASKS) -> dict:
    """How strange the final evaluation's replies read to the base model (bench/reply_surprise.py)."""
    return surprise([(tasks[r["task_index"]], reading(server, tasks[r["task_index"]], r["first_reply"]))
                     for r in replies], reference, [r["score"] for r in replies])


def reread(paths: list[str]) -> None:
    """Add the surprise figure to saved results whose final evaluation predates it (SmolLM2 runs
    of the embedded engine: the base model and its seeded sampling are what the run had)."""
    references: dict[tuple[int, float, str], dict] = {}
    with bench_server(bench_model(smol=True), "policy", learn=False, judge_enabled=False) as server:
        for path in map(Path, paths):
            result = json.loads(path.read_text())
            if result.get("model") != "SmolLM2-135M-Instruct":
                print(f"{path.name}: not a SmolLM2 run, left as it is")
                continue
            asked = QUESTIONS[result.get("questions") or "everyday"].asked
            key = (result["settings"]["max_tokens"], result["settings"]["temperature"], result.get("questions") or "")
            for run, summary in zip(result["runs"], result["summary"]):
                if run.get("final"):
                    if key not in references:
                        references[key] = reference_readings(server, *key[:2], asked)
                    figures = replies_surprise(server, run["final"]["samples"], references[key], asked)
                    run["final"].update(figures)
                    summary["final"].update(figures)
                    print(f"{path.name} ({run['mode']}): surprise {figures['surprise']} ± {figures['surprise_stderr']}",
                          flush=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
            render(path)


def standard_error(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.stdev(present) / len(present) ** 0.5, 4) if len(present) > 1 else None


def final_evaluation(server, user: str, args, scorer, base_prose: list[tuple[float, int]],
                     reference: dict[str, list[list[float]]] | None = None,
                     held_reference: dict[str, list[list[float]]] | None = None) -> dict:
    """`args.final_samples` replies to each question asked from the version serving `user` now,
    scored and measured as the runs' first replies are, and as many to each held-out question
    (`reference`, `held_reference`: reference_readings() of the asked and the held-out questions,
    read here when not given). The learner must be stopped first: a version it published
    meanwhile would unload the one being evaluated."""
    questions = questions_of(args)
    if reference is None:
        reference = reference_readings(server, args.max_tokens, args.temperature, questions.asked)
    if held_reference is None:
        held_reference = reference_readings(server, args.max_tokens, args.temperature, questions.held_out)
    policy = server.app.state.services.turns.policies.current(user)
    replies = sampled_and_scored(server, policy.adapter, questions.asked, args.final_samples, args, scorer)
    scores = [r["score"] for r in replies]
    return {
        "version": policy.version,
        **perplexity_figures(held_out_nll(server, policy.adapter), base_prose),
        **replies_surprise(server, replies, reference, questions.asked),
        "replies": len(replies),
        "score": round(statistics.fmean(scores), 3),
        "score_stderr": standard_error(scores),
        "repetition": mean_repetition(replies),
        "repetition_stderr": standard_error([repetition(r["first_reply"]) for r in replies]),
        "repetition_length_matched": mean_repetition(replies, LENGTH_MATCHED_WORDS),
        "words_per_reply": round(statistics.fmean(len(r["first_reply"].split()) for r in replies), 1),
        "samples": replies,
        # the same on the questions never asked: the wish learnt, not the questions
        "held_out": held_out_reading(server, policy.adapter, args.final_samples, args, scorer, held_reference),
    }


# Held-out general text for the quality check: a version that learnt a person's preference must
# still model ordinary prose about as well as the base model (mean negative log-likelihood per
# token, as perplexity). ~2,300 tokens written for this bench, apart from the gate's own probe:
# the six passages it began with (~250 tokens) could not tell a 1-2% change from chance.
GENERAL_TEXT = tuple(line for line in (Path(__file__).parent.parent.joinpath("held_out_prose.txt").read_text(encoding="utf-8").splitlines())
                     if line.strip() and not line.startswith("#"))


def held_out_nll(server, adapter: str | None) -> list[tuple[float, int]]:
    """Negative log-likelihood and token count of each GENERAL_TEXT passage under `adapter`
    (None: the base model)."""
    turns = server.app.state.services.turns
    tokenizer = turns.renderer.tokenizer
    passages = []
    for text in GENERAL_TEXT:
        ids = tokenizer.encode(text, add_special_tokens=False)
        scores = server.call(turns.engine.score(ids, 1, adapter=adapter), timeout=600)
        passages.append((-sum(scores), len(scores)))
    return passages


def perplexity_figures(version: list[tuple[float, int]], base: list[tuple[float, int]]) -> dict:
    """The version's perplexity on the held-out prose over the base model's, with a standard
    error from the passages' spread (the text is a sample of prose; the error says how much a
    different sample of the same size might read)."""
    tokens = sum(count for _, count in base)
    nll, base_nll = sum(n for n, _ in version) / tokens, sum(n for n, _ in base) / tokens
    ratio = math.exp(nll - base_nll)
    per_passage = [(v - b) / count for (v, count), (b, _) in zip(version, base)]
    return {
        "held_out_nll": round(nll, 4),
        "base_held_out_nll": round(base_nll, 4),
        "held_out_tokens": tokens,
        "perplexity_ratio": round(ratio, 4),
        "perplexity_ratio_stderr": round(ratio * statistics.stdev(per_passage) / math.sqrt(len(per_passage)), 4),
    }


def sensible_scores(tasks: list[dict]) -> list[float] | None:
    """Each first reply's score, counted only where it reads no stranger than SENSIBLE_SURPRISE
    to the base model (None for runs saved before the tasks carried their surprise)."""
    if not tasks or "surprise" not in tasks[0]:
        return None
    return [t["score"] if t["surprise"] is not None and t["surprise"] <= SENSIBLE_SURPRISE else 0.0 for t in tasks]


def by_window(scores: list[float]) -> list[float]:
    return [round(statistics.fmean(scores[i:i + WINDOW]), 3) for i in range(0, len(scores), WINDOW)]


def updates_to_reach(tasks: list[dict], target: float = 0.8, window: int = 16) -> int | None:
    """The version serving when the first replies' trailing mean over `window` tasks first
    reaches `target` (= updates needed); None if it never does."""
    for end in range(window, len(tasks) + 1):
        if statistics.fmean(t["score"] for t in tasks[end - window:end]) >= target:
            return tasks[end - 1]["version"]
    return None


def task_list(seed: int, n: int, asked: list[str] = TASKS) -> list[str]:
    order = random.Random(seed)
    return [asked[order.randrange(len(asked))] for _ in range(n)]


def mean_repetition(tasks: list[dict], words: int | None = None) -> float | None:
    """Mean repeated-word share of the tasks' first replies; with `words`, over the first
    `words` words of the replies that have as many: longer replies repeat more ("the", "a")
    without degenerating, and learning the preference lengthened SmolLM2's replies."""
    texts = [t["first_reply"] for t in tasks]
    if words is not None:
        texts = [text for text in texts if len(split_words(text)) >= words]
    values = [r for r in (repetition(text, words) for text in texts) if r is not None]
    return round(statistics.fmean(values), 3) if values else None


LENGTH_MATCHED_WORDS = 16
WINDOW = 16  # tasks per window of the curves across seeds (seeds_report)


def without_samples(final: dict) -> dict:
    """The final evaluation's figures without the replies themselves (the summary's copy)."""
    out = {k: v for k, v in final.items() if k != "samples"}
    if isinstance(out.get("held_out"), dict):
        out["held_out"] = {k: v for k, v in out["held_out"].items() if k != "samples"}
    return out
