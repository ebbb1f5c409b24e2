"""One run of the bench: a server at the settings asked, the simulated person asking its tasks in
order and reacting to each reply, the learner given time to publish what it learnt."""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from openai import OpenAI

from bench import base_cache
from bench.models import bench_server
from bench.personalization.evaluation import (
    GENERAL_TEXT,
    without_samples,
    sampled_for_each,
    sampled_replies,
    final_evaluation,
    held_out_nll,
    held_out_reading,
    perplexity_figures,
    reference_readings,
    sampled_texts,
)
from bench.personalization.person import INSTRUCTIONS, TASKS, questions_of, react
from bench.reply_surprise import REFERENCE_REPLIES, of_reply, reading


@dataclass
class TaskRecord:
    task_index: int
    version: int  # policy version that served the first reply (X-Policy-Version)
    score: float
    first_reply: str
    attempts: int  # replies until one fitted (0 = none did)
    seconds: float
    surprise: float | None = None  # the first reply's, to the base model (bench/reply_surprise.py); None if empty


@dataclass
class ModeRun:
    mode: str
    tasks: list[TaskRecord] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    calibration: dict | None = None  # the judge's start-up check, as the server saw it
    final: dict | None = None  # final_evaluation() of the version serving after the last task
    # per version served: its perplexity on the held-out prose over the base model's, minus one
    # (the bench's own reading of what the gate calls forgetting)
    prose_forgetting: dict[int, float] = field(default_factory=dict)
    # per version served (v0: the base model): the ratings the person had given when it began
    # serving, and the share of its replies to the held-out questions that fit the wish
    held_out: dict[int, dict] = field(default_factory=dict)
    stopped_after: int | None = None  # tasks done when the run was stopped early (StopRequest)


class StopRequest:
    """Ends a run's tasks at the next task boundary, on SIGTERM or once `minutes` have passed:
    the learner is closed, the final evaluation runs and the result is written as if the tasks
    had ended there (`stopped_after` says where). A batch-8 run takes hours on two cores, and
    one stopped for a session's end used to keep only its log. A second SIGTERM stops at once."""

    def __init__(self, minutes: float | None = None) -> None:
        self.deadline = time.monotonic() + 60 * minutes if minutes else None
        self.signalled = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("stop requested: the run ends after the task under way (again to stop at once)", flush=True)

    @property
    def requested(self) -> bool:
        return self.signalled or (self.deadline is not None and time.monotonic() >= self.deadline)


def engine_settings(args) -> dict:
    """The policy runs in nextstate's embedded engine, or on an SGLang server (--sglang-url)."""
    return {"engine": "sglang", "sglang_url": args.sglang_url} if args.sglang_url else {}


def probe_marker(policy: Path, engine: dict, marker: str | None, target: float) -> tuple[str, float, float]:
    """The marker (given, or the word-like first token whose mean probability over the tasks is
    nearest `target`), with its mean first-token probability without and with the marker
    instruction appended as the OPD teacher sees a hint: whether the policy can read the hint."""
    from nextstate.judge.teacher import enhanced_messages

    from bench.learning import _first_token_probs

    with bench_server(policy, "policy", learn=False, judge_enabled=False, **engine) as server:
        chat = server.app.state.services.turns
        tokenizer = chat.renderer.tokenizer

        def mean_probs(hint: str | None) -> list[float]:
            sums: list[float] = []
            for task in TASKS:
                messages = enhanced_messages([{"role": "user", "content": task}], hint or "")
                probs = server.call(_first_token_probs(chat.engine, chat.renderer.render(messages).ids, None))
                sums = probs if not sums else [a + b for a, b in zip(sums, probs)]
            return [x / len(TASKS) for x in sums]

        plain = mean_probs(None)
        if marker is None:
            candidates = [(abs(p - target), i) for i, p in enumerate(plain)
                          if tokenizer.decode([i]).strip().isalpha() and p > 0.01]
            if not candidates:
                raise SystemExit("no word-like first token with probability > 1% — give --rule marker:WORD explicitly")
            token = min(candidates)[1]
            marker = tokenizer.decode([token]).strip()
        else:
            token = tokenizer.encode(marker, add_special_tokens=False)[0]
        hinted = mean_probs(INSTRUCTIONS["marker"].format(marker))
    return marker, plain[token], hinted[token]


def overrides(pairs: list[str] | None) -> dict[str, str]:
    """`--set NAME=VALUE` pairs: any server setting, by its field name (the NEXTSTATE_ variable
    without the prefix, lower case), for an ablation of a setting with no flag of its own."""
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set takes NAME=VALUE, not {pair!r}")
        out[name.strip().lower().removeprefix("nextstate_")] = value
    return out


def run_mode(mode: str, policy: Path, tasks: list[str], args, judge: dict, user, scorer,
             stop: StopRequest | None = None) -> ModeRun:
    run = ModeRun(mode)
    learning = mode != "none"
    tuned = {} if args.defaults else dict(
        prm_votes=args.votes, batch_size=args.batch, lr=args.lr, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
    )
    if getattr(args, "no_gate", False):
        tuned["publish_gate"] = False
    if getattr(args, "gate_max_repetition_rise", None) is not None:
        tuned["gate_max_repetition_rise"] = args.gate_max_repetition_rise
    if getattr(args, "gate_backtracks", None) is not None:
        tuned["gate_backtracks"] = args.gate_backtracks
    if getattr(args, "judge_fallback", None) is not None:
        tuned["judge_fallback"] = args.judge_fallback
    tuned.update(overrides(getattr(args, "set", None)))
    with bench_server(
        policy, "policy", mode=mode if learning else "combined", learn=learning, judge_enabled=learning,
        **tuned, **judge, **engine_settings(args),
    ) as server:
        client = OpenAI(base_url=server.base_url, api_key=server.key("simulated-user"), max_retries=0, timeout=600)
        wants_answers = getattr(args, "sensible_user", False)
        held_out_samples = getattr(args, "held_out_samples", 0) if learning else 0
        base = base_model_readings(server, policy, args, held_out_samples, tuned)
        base_prose, reference = base["prose"], base["reference"]
        run.prose_forgetting[0] = 0.0
        ratings = 0  # reactions the person gave so far: each reply's next state is one
        if held_out_samples:
            held_reference = base["held_reference"]
            run.held_out[0] = {"ratings": ratings} | without_samples(held_out_reading(
                server, None, held_out_samples, args, scorer, held_reference,
                [t[:held_out_samples] for t in base["held_texts"]]))
        for i, task in enumerate(tasks):
            started = time.perf_counter()
            messages = [{"role": "user", "content": task}]
            version, first, first_surprise, attempts = None, None, None, 0
            for attempt in range(1, args.max_attempts + 1):
                raw = client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=args.max_tokens, temperature=args.temperature,
                    seed=args.seed * 100_003 + i * 7 + attempt,
                )
                completion = raw.parse()
                reply = completion.choices[0].message.content or ""
                # read by the base model where it counts: every reply the sensible user judges, every first reply
                strangeness = of_reply(task, reading(server, task, reply), reference) \
                    if wants_answers or first is None else None
                if first is None:
                    first, version, first_surprise = reply, int(raw.headers["x-policy-version"]), strangeness
                fitted, reaction = react(user, task, reply, strangeness, wants_answers)
                ratings += 1
                if args.feedback:  # the user also rates the reply itself, as README's POST /v1/feedback
                    client.post("/feedback", cast_to=object, body={
                        "response_id": completion.id, "rating": 1 if fitted else -1,
                        **({} if fitted else {"correction": user.preference.instruction}),
                    })
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": reaction}]
                if fitted:
                    attempts = attempt
                if fitted or attempt == args.max_attempts:
                    # The reaction is the last reply's next state; sending it is what lets that reply be judged.
                    client.chat.completions.create(model="policy", messages=messages, max_tokens=1, seed=i)
                    break
            record = TaskRecord(i, version, scorer.score(task, first), first, attempts,
                                round(time.perf_counter() - started, 3), first_surprise)
            run.tasks.append(record)
            if (i + 1) % 10 == 0 or i + 1 == len(tasks):
                recent = [t.score for t in run.tasks[-16:]]
                print(f"{mode:>8}: task {i + 1}/{len(tasks)}, serving v{version}, score (last 16) "
                      f"{statistics.fmean(recent):.2f}", flush=True)
            time.sleep(args.think_s)  # the user reads the reply; background judging and learning run
            if learning and getattr(args, "wait_for_learner", False):
                wait_for_learner(server, "simulated-user", getattr(args, "learner_wait_s", LEARNER_WAIT_S))
            if learning and (policy := server.app.state.services.turns.policies.current("simulated-user")).version \
                    not in run.prose_forgetting:  # a new version serves: read it before the next replaces it
                with version_held(server, "simulated-user", policy.version) as adapter:
                    figures = perplexity_figures(held_out_nll(server, adapter), base_prose)
                    run.prose_forgetting[policy.version] = round(figures["perplexity_ratio"] - 1, 5)
                    if held_out_samples:
                        held = run.held_out[policy.version] = {"ratings": ratings} | without_samples(
                            held_out_reading(server, adapter, held_out_samples, args, scorer, held_reference))
                        print(f"{mode:>8}: v{policy.version} after {ratings} ratings: held-out questions "
                              f"{held['score']:.2f} ({held['score_sensible']:.2f} with sense)", flush=True)
            if stop is not None and stop.requested and i + 1 < len(tasks):
                run.stopped_after = i + 1
                print(f"{mode:>8}: stopped after task {i + 1}/{len(tasks)}", flush=True)
                break
        if learning:  # the run's learning ends with its tasks: a step still under way would not serve them
            server.call(server.app.state.services.learner.aclose())
        run.steps = [{k: v for k, v in s.items() if k != "sample_ids"} | {"samples": len(s.get("sample_ids", []))}
                     for s in server.app.state.services.learner.steps] if learning else []
        run.calibration = server.app.state.services.judge.calibration.to_dict() if learning else None
        if args.final_samples:
            run.final = final_evaluation(server, "simulated-user", args, scorer, base_prose, reference,
                                         held_reference if held_out_samples else None)
            print(f"{mode:>8}: final evaluation of v{run.final['version']}: score {run.final['score']:.3f} "
                  f"(± {run.final['score_stderr']}), repeated words {run.final['repetition']} over "
                  f"{run.final['replies']} sampled replies", flush=True)
    return run


def base_model_readings(server, policy: Path, args, held_out_samples: int, tuned: dict) -> dict:
    """What every run on this model starts from — the base model's prose perplexity, its replies
    to the questions and its readings of them — from bench/base_cache.py's cache when it holds
    them for these inputs (they took 5 of a run's 25 minutes alone, 31 beside three others)."""
    from nextstate.core.settings import EngineSettings

    questions = questions_of(args)
    parameters = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                  "questions": getattr(args, "questions", None) or "everyday", "held_out_samples": held_out_samples,
                  "reference_replies": REFERENCE_REPLIES, "engine_settings": {k: v for k, v in tuned.items() if k in EngineSettings.model_fields},
                  "asked": questions.asked, "held_out": questions.held_out, "prose": GENERAL_TEXT}

    def compute() -> dict:
        readings = {"prose": held_out_nll(server, None),
                    "reference": reference_readings(server, args.max_tokens, args.temperature, questions.asked)}
        if held_out_samples:
            # the base model's reference and its own reading share their seeds: one sampling serves both
            texts = sampled_texts(server, None, questions.held_out, max(held_out_samples, REFERENCE_REPLIES),
                                  args.max_tokens, args.temperature)
            readings |= {"held_texts": texts, "held_reference": reference_readings(
                server, args.max_tokens, args.temperature, questions.held_out, [t[:REFERENCE_REPLIES] for t in texts])}
        return readings

    code = (base_model_readings, held_out_nll, reference_readings, sampled_texts, sampled_for_each, sampled_replies)
    # an SGLang server is known here by its URL alone, not by the model and version behind it: read afresh
    fresh = getattr(args, "fresh_base", False) or bool(engine_settings(args))
    readings, hit = base_cache.cached("personalization-base", policy, parameters, compute, code, fresh=fresh)
    print(f"base model's readings: {'from the cache' if hit else 'read and kept'} ({base_cache.cache_dir()})",
          flush=True)
    return readings


@contextlib.contextmanager
def version_held(server, user: str, version: int):
    """A copy of `user`'s published `version`, loaded under the bench's own name for as long as
    it is read: the readings take minutes on two cores, and meanwhile the learner's timer may
    train a partial batch (its oldest sample waited NEXTSTATE_BATCH_WAIT_S), publish the next
    version and unload this one from under the reading (a batch-8 run stopped so, mid-reading)."""
    services = server.app.state.services
    scope = services.turns.policies.scope_of(user)
    name = f"bench-read-{scope}-v{version}"
    server.call(services.engine.load_adapter(name, str(services.learner.versions.path(scope, version))))
    try:
        yield name
    finally:
        server.call(services.engine.unload_adapter(name))


LEARNER_WAIT_S = 1800.0  # wait_for_learner's give-up, --learner-wait-s


def wait_for_learner(server, user: str, timeout_s: float = LEARNER_WAIT_S) -> None:
    """Hold the simulated user until the learner has trained every full batch it has: so many
    updates per task whatever the machine's speed (on two CPU cores an update takes a minute,
    and a run that does not wait gets as many updates as the cores allow, the same settings
    giving 1 or 4 by how busy the machine was). `timeout_s` only keeps a stuck learner from
    holding the run for ever: at a batch of 2 one task's samples can make two updates in a row,
    each an update and a gate check of 5-6 minutes on cores shared by four runs, and the 600 s
    of before 2026-12-03 then let the next task be served by the version before."""
    services = server.app.state.services
    batch = services.settings.learner.batch_size
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.call(services.judge.drain(60), timeout=90)  # the samples of the task just done are in
        learner = services.learner
        full = services.samples.ready_counts_by_user().get(user, 0) >= batch
        if learner.training is None and (not full or user in learner.waiting):  # nothing to train, or held back
            return
        time.sleep(0.5)
    print(f"wait_for_learner: gave up after {timeout_s:g} s", flush=True)
