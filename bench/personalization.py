"""Does it learn a person's preference from how they react? The paper's §5.1/5.3 in miniature.

    pip install -e '.[bench]'
    python -m bench.personalization                 # peaked tiny model, rule-based user/judge/scorer
    python -m bench.personalization --smol          # the embedded SmolLM2 as the policy
    python -m bench.personalization --policy DIR \\
        --user-url URL --user-model M --judge-url URL --judge-model M --scorer-url URL --scorer-model M \\
        --preference "Answer like a person texting a friend: lowercase, no lists."

A simulated user with a hidden preference talks to nextstate over the real HTTP API through
the `openai` SDK, as a stock client: no session headers, nothing nextstate-specific. For each
fresh task it asks once; when the reply misses its preference it answers "No, ..." with the
preference and asks again (at most twice), when a reply fits it says thanks. nextstate infers
the sessions, judges each reply from the user's reaction (its next state), and learns online
in the mode under test. A scorer, separate from the judge, rates the *first* reply to every
fresh task against the preference; the curve of that score over the tasks is the result.
Beside it, the share of repeated words in each first reply: a rule scorer sees only the
preference, and a policy that learns it by degenerating (binary RL at a high learning rate
does) repeats itself.

Modes, run one after another on the same policy, tasks and seeds (every request carries
`seed`, so until the first update all modes see the same replies): `none` (serving only: the
baseline), `binary`, `opd` and `combined` (NEXTSTATE_MODE).

**Rule-based mode** (the default; a tiny model cannot play a user or a judge):

* preference — "Always begin your reply with a capital letter." on the tiny model: its replies
  already do now and then (~17% — the paper's base score is 0.17), so the preference is
  reachable but not given. Also `--rule digit` ("include a number") and `--rule marker:WORD`;
  `marker:auto` (the default for other policies) picks the word-like first token whose mean
  base probability over the tasks is nearest `--target` (0.15). For a marker, the result also
  records its probability with the instruction appended as the OPD teacher sees a hint.
* user — checks the rule: "Thanks, that's exactly how I like it." or "No, that's not how I
  like it. <the instruction> Please try again: <task>".
* judge — an OpenAI-compatible server in this process (tests/judge_server.py's rules): a next
  state with thanks → \\boxed{1}, one starting "No" → \\boxed{-1}; hint judge: for a correction,
  the user's own instruction sentence as the hint, otherwise \\boxed{-1}. This is the judge a
  capable model would be on these messages, minus its noise.
* scorer — the same rule on the first reply to each task: 1 or 0.

On the tiny model OPD has nothing to distil: the teacher is the same random network reading
the hint, which it cannot understand, so opd is expected not to help there. Use --smol or
--policy for a model that can read a hint.

**Model mode**: `--user-url/--judge-url/--scorer-url` (+ `--*-model`, API key from
`--api-key-env`, default OPENAI_API_KEY) make any of the three an OpenAI-compatible model,
with `--preference` in words; `--sglang-url` serves the policy from SGLang. `--lr`, `--kl-coef`
and `--batch` set the learner; `--variant NAME` gives a run with other settings its own file.
**Final evaluation**: the 48 first replies of a run's last quarter score it to about ±0.07,
as large as the differences between settings. So after the last task each learning run also
samples `--final-samples` (16) replies to each of the 24 tasks from the version then serving,
in-process through the engine (no session, nothing judged or learnt), with seeds that are the
same for every run and mode: runs compare on the same random draws, and 384 replies measure
score and repetition to about ±0.02. The `none` mode's final evaluation is the base model's.
**Held-out questions**: 24 more questions the simulated user never asks (HELD_OUT_TASKS). The
final evaluation samples them too, and each version is read on them as it begins serving
(`--held-out-samples`, 2 replies a question), beside the ratings the person had given by then:
whether the wish, not the 24 questions it was corrected on, was learnt — and how soon (the
first version after 15 ratings is the summary's `held_out_after_ratings`).

Writes bench/results/personalization-<policy>[-<variant>][-<gpu>].json and a PNG;
`--report FILE...` prints saved results as the table BENCHMARKS.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openai import OpenAI

from bench import base_cache
from bench.models import bench_model, bench_server
from bench.reply_surprise import REFERENCE_REPLIES, SENSIBLE_SURPRISE, of_reply, reading, surprise
from bench.report import pyplot, render, save
from nextstate.core.settings import JudgeSettings, LearnerSettings
from nextstate.engine.base import SamplingParams
from nextstate.learner.gate import GATE_PROMPTS, repetition, split_words
from tests.judge_server import ScriptedJudge

MODES = ("none", "binary", "opd", "combined")
TASKS = [
    "Write a one-line greeting for a birthday card.",
    "Suggest a name for a small bakery.",
    "Give me a tip for sleeping better.",
    "Describe the sea in one sentence.",
    "What should I cook tonight?",
    "Summarise why people keep diaries.",
    "Write a short thank-you note to a teacher.",
    "How do I politely decline a meeting?",
    "Give me a fun fact about owls.",
    "Explain what a budget is to a child.",
    "Suggest a weekend activity for a rainy day.",
    "Write a slogan for a bicycle shop.",
    "What is a good way to start learning guitar?",
    "Describe autumn in a few words.",
    "Give me a reason to drink more water.",
    "How can I remember names better?",
    "Write a caption for a photo of a cat.",
    "Recommend a habit for a productive morning.",
    "Explain recycling in one sentence.",
    "Suggest a title for a short story about a lighthouse.",
    "What is a kind thing to say to a tired friend?",
    "Give me an idea for a picnic.",
    "Describe the taste of lemon.",
    "Write a reminder to call my mother.",
]
# Questions the simulated user never asks: where a version shows whether it learnt the person's
# wish or only the 24 questions it was corrected on. Same register and spread of kinds (greetings,
# names, tips, descriptions, explanations), none a paraphrase of a task above.
HELD_OUT_TASKS = [
    "Write a one-line message to congratulate a friend on a new job.",
    "Suggest a name for a pet goldfish.",
    "Give me a tip for staying focused while studying.",
    "Describe a forest in one sentence.",
    "What should I do on a lazy Sunday?",
    "Summarise why people enjoy gardening.",
    "Write a short apology for being late.",
    "How do I ask my neighbour to turn the music down?",
    "Give me a fun fact about octopuses.",
    "Explain what a map is to a child.",
    "Suggest a hobby I can do at home.",
    "Write a slogan for a flower shop.",
    "What is a good way to start running?",
    "Describe winter in a few words.",
    "Give me a reason to go for a walk.",
    "How can I keep my desk tidy?",
    "Write a caption for a photo of a sunset.",
    "Recommend a habit for a calm evening.",
    "Explain rain in one sentence.",
    "Suggest a title for a poem about the moon.",
    "What is a kind thing to say to a nervous student?",
    "Give me an idea for a day at the beach.",
    "Describe the sound of the wind.",
    "Write a reminder to water the plants.",
]
# The topic kind's questions: outings, visits and evenings, where a reply suggests food unasked
# (the everyday questions above mention it 6% of the time: nothing to learn, "KINDS" below).
OUTINGS = [
    "Give me an idea for a picnic.",
    "What should I bring to a friend's housewarming?",
    "Plan a cosy evening at home.",
    "Suggest a way to celebrate a birthday.",
    "What can I do on a Sunday morning?",
    "How do I make guests feel welcome?",
    "Suggest an idea for a date night.",
    "What should I pack for a road trip?",
    "Give me a tip for a long day of hiking.",
    "How can I make a rainy afternoon fun for kids?",
    "Describe a perfect summer day.",
    "What is a nice thing to do for a sick friend?",
    "Suggest a theme for a small party.",
    "How can I have more energy in the afternoon?",
    "Describe a cosy winter evening.",
    "Give me an idea for a family get-together.",
    "What should I do to relax after work?",
    "Describe a market in a small town.",
    "Suggest something to do on a first visit to Paris.",
    "How do I prepare for a camping trip?",
    "Give me an idea for a holiday tradition.",
    "What is a good way to spend a lunch break?",
    "Suggest a way to thank a neighbour.",
    "Plan a simple Saturday with friends.",
]
HELD_OUT_OUTINGS = [
    "Suggest a fun way to spend a Saturday afternoon.",
    "What should I bring to a baby shower?",
    "Plan a relaxing evening for two.",
    "How can I celebrate finishing my exams?",
    "Give me an idea for a school fundraiser.",
    "What can I do with visiting grandparents?",
    "Describe a lively street festival.",
    "Suggest an activity for a team outing.",
    "What should I pack for a day at the lake?",
    "How do I host a board game night?",
    "Describe a perfect autumn weekend.",
    "What is a thoughtful gift for a new neighbour?",
    "Give me an idea for a surprise for my partner.",
    "How can I make a long train journey pleasant?",
    "Suggest a way to welcome a new colleague.",
    "What should I do on the first day of a holiday?",
    "Plan a quiet morning before a busy day.",
    "Give me an idea for a garden party.",
    "How do I keep children busy on a long flight?",
    "Describe a village fair.",
    "Suggest a way to spend New Year's Eve.",
    "What is a good plan for a rainy holiday?",
    "How can I make a friend's visit special?",
    "Suggest a way to spend a long summer evening.",
]


@dataclass(frozen=True)
class Questions:
    """What a kind's simulated user asks, and the questions held out from it."""

    name: str
    asked: list[str]
    held_out: list[str]


QUESTIONS = {"everyday": Questions("everyday", TASKS, HELD_OUT_TASKS),
             "outings": Questions("outings", OUTINGS, HELD_OUT_OUTINGS)}


def questions_of(args) -> Questions:
    """The questions a run asks (args.questions: a QUESTIONS name; the everyday ones if unset)."""
    return QUESTIONS[getattr(args, "questions", None) or "everyday"]


THANKS = "Thanks, that's exactly how I like it."
NOT_AN_ANSWER = "No, that doesn't answer my question."


@dataclass
class Preference:
    """What the simulated user wants. `rule` is checkable without a model: "capital" (the reply
    begins with a capital letter), "digit" (it contains a number), "marker:WORD" (it begins with
    WORD), "short", "lowercase", "nolist", "list" (two list lines or more), "avoid:WORDS"; "" when
    a model user and scorer judge the words of `instruction` instead."""

    instruction: str  # what the user says when a reply misses, and what the hint judge extracts
    rule: str = ""

    def fits(self, reply: str) -> bool:
        text = reply.strip()
        if self.rule == "capital":
            return text[:1].isupper()
        if self.rule == "digit":
            return re.search(r"\d", text) is not None
        if self.rule.startswith("marker:"):
            return text.startswith(self.rule.removeprefix("marker:"))
        if self.rule == "short":
            return 0 < len(text.split()) <= SHORT_WORDS
        if self.rule == "lowercase":
            return bool(text) and not any(c.isupper() for c in text)
        if self.rule == "nolist":
            return bool(text) and not LIST_LINE.search(text)
        if self.rule == "list":
            return len(LIST_LINE.findall(text)) >= 2
        if self.rule.startswith("avoid:"):
            return bool(text) and not avoided(self.rule).search(text)
        raise ValueError("a preference without a rule needs a model user and scorer (--user-url, --scorer-url)")


# The preference kinds of issue 38 besides the opening word: a length, a format, a case, a topic.
SHORT_WORDS = 12
LIST_LINE = re.compile(r"(?m)^\s*(?:[-*•]|\d+[.)])\s")
# Food as a person who says "never mention food or drink" means it: meals, snacks, a coffee.
AVOIDED_TOPIC = ("avoid:food,foods,eat,eats,eating,ate,cook,cooks,cooking,cooked,meal,meals,dinner,dinners,breakfast,"
                 "brunch,lunch,lunches,recipe,recipes,snack,snacks,drink,drinks,coffee,tea,cake,cakes,pizza,sandwich,"
                 "sandwiches,fruit,fruits,dessert,desserts,chocolate,bake,baking,baked,cookie,cookies,delicious,tasty,"
                 "menu,restaurant,restaurants,wine,beer,cocktail,cocktails,bread,cheese,soup,salad,salads,barbecue,"
                 "bbq,grill,grilled,feast")


def avoided(rule: str) -> re.Pattern:
    words = rule.removeprefix("avoid:").split(",")
    return re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)


INSTRUCTIONS = {
    "capital": "Always begin your reply with a capital letter.",
    "digit": "Always include at least one number in your reply.",
    "marker": "Always begin your reply with '{}'.",
    "short": f"Answer in one short sentence of at most {SHORT_WORDS} words.",
    "lowercase": "Write in lowercase letters only, with no capital letters at all.",
    "nolist": "Never use lists or bullet points: answer in plain prose.",
    "list": "Always answer as a bulleted list: at least two lines, each starting with '- '.",
    "avoid": "Never mention food or drink: no meals, snacks, eating or cooking.",
}
def instruction_for(rule: str) -> str | None:
    """What the simulated user says of a rule-checked preference (None: no such rule)."""
    if rule.startswith("marker:"):
        return INSTRUCTIONS["marker"].format(rule.removeprefix("marker:"))
    if rule.startswith("avoid:"):
        return INSTRUCTIONS["avoid"] if rule == AVOIDED_TOPIC else f"Never mention {rule.removeprefix('avoid:')}."
    return INSTRUCTIONS.get(rule)


# `--kind NAME`: each preference kind of the issue's table, by name. The format is "a bulleted
# list" rather than "no lists": SmolLM2 answers these tasks without a list 99% of the time
# (measured over 72 replies, 2026-11-26), so "no lists" measured nothing; a list it writes 1%.
# The topic to avoid, food, is mentioned in 6% of the everyday questions' replies (the cooking
# and picnic tasks), and no everyday topic measured had more (feelings 10%, nature 11%): the
# topic kind asks its own questions, the OUTINGS, where food or drink comes up unasked — in 23%
# of SmolLM2's replies to them and 10% to their held-out ones (48 replies each, 48 tokens at
# temperature 1, 2026-11-28): still little room, but four times the everyday questions'. No
# candidate topic does better (bench/topic_rates.py: at most 0.28 of replies), so the kind
# cannot be measured on SmolLM2-135M (BENCHMARKS.md, twenty-first pass of issue 38).
KINDS = {"opening": "marker:auto", "length": "short", "format": "list", "case": "lowercase", "topic": AVOIDED_TOPIC}
KIND_QUESTIONS = {"topic": "outings"}


class ChatModel:
    """Any OpenAI-compatible chat model, for playing the user or the scorer."""

    def __init__(self, url: str, model: str, api_key: str | None) -> None:
        self.client = OpenAI(base_url=url, api_key=api_key or "none", max_retries=2, timeout=120)
        self.model = model

    def ask(self, prompt: str) -> str:
        reply = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=400
        )
        return reply.choices[0].message.content or ""


def missed(instruction: str, task: str) -> str:
    """What the rule user says to a reply that misses the wish."""
    return f"No, that's not how I like it. {instruction} Please try again: {task}"


def not_an_answer(instruction: str, task: str) -> str:
    """What the sensible user says to a reply that reads as nonsense (`react`)."""
    return f"{NOT_AN_ANSWER} {instruction} Please try again: {task}"


class RuleUser:
    def __init__(self, preference: Preference) -> None:
        self.preference = preference

    def react(self, task: str, reply: str) -> tuple[bool, str]:
        if self.preference.fits(reply):
            return True, THANKS
        return False, missed(self.preference.instruction, task)


class ModelUser:
    PROMPT = (
        "You are role-playing a person using an AI assistant. Your preference, which you never state unless "
        "the assistant misses it: {instruction}\n\nYou asked: {task}\n\nThe assistant replied:\n{reply}\n\n"
        "If the reply follows your preference, write a short thank-you that starts with \"Thanks\". Otherwise "
        "write a message that starts with \"No,\", says what you want differently, and asks again. "
        "Write only your message."
    )

    def __init__(self, model: ChatModel, preference: Preference) -> None:
        self.model, self.preference = model, preference

    def react(self, task: str, reply: str) -> tuple[bool, str]:
        text = self.model.ask(self.PROMPT.format(instruction=self.preference.instruction, task=task, reply=reply)).strip()
        return text.lower().startswith("thank"), text


def react(user, task: str, reply: str, strangeness: float | None, wants_answers: bool) -> tuple[bool, str]:
    """The simulated user's reaction to `reply`. With `wants_answers` (--sensible-user), a reply
    the base model reads as nonsense (`strangeness`: its surprise, bench/reply_surprise.py, over
    SENSIBLE_SURPRISE, or an empty reply) is turned down whatever the wish says: a person who
    asks for short replies still wants an answer, and a rule user that thanks "Ladle." for a
    bakery name teaches the learner that nonsense is welcome (the length wish's 0.86, 2026-11-27)."""
    if wants_answers and (strangeness is None or strangeness > SENSIBLE_SURPRISE):
        return False, not_an_answer(user.preference.instruction, task)
    return user.react(task, reply)


class RuleScorer:
    def __init__(self, preference: Preference) -> None:
        self.preference = preference

    def score(self, task: str, reply: str) -> float:
        return 1.0 if self.preference.fits(reply) else 0.0


class ModelScorer:
    PROMPT = (
        "Rate whether an assistant's reply follows a user's preference.\n\nPreference: {instruction}\n\n"
        "Task: {task}\n\nReply:\n{reply}\n\nGive a score from 0 (ignores the preference) to 1 (follows it "
        "fully) as the last thing you write, inside \\boxed{{}}, e.g. \\boxed{{0.5}}."
    )

    def __init__(self, model: ChatModel, preference: Preference) -> None:
        self.model, self.preference = model, preference

    def score(self, task: str, reply: str) -> float:
        """The last \\boxed{} number, clipped to [0, 1]; an answer without one scores 0."""
        text = self.model.ask(self.PROMPT.format(instruction=self.preference.instruction, task=task, reply=reply))
        found = re.findall(r"\\boxed\{\s*(\d+(?:\.\d+)?)\s*\}", text)
        return min(1.0, float(found[-1])) if found else 0.0


# What the judge's hint says of a reply turned down as nonsense, before the wish
# (PreferenceJudge's nonsense_hint="answer").
ANSWER_HINT = "Give a real answer to my question."
NONSENSE_HINTS = ("wish", "answer")  # PreferenceJudge's nonsense_hint, --nonsense-hint


class PreferenceJudge(ScriptedJudge):
    """The rule judge, with the hint taken from the user's correction: its instruction sentence.

    `nonsense_hint`: what the hint says when the sensible user turned a reply down as nonsense
    (NOT_AN_ANSWER): "wish", the wish's sentence alone, as for a missed wish; "answer",
    ANSWER_HINT before it, as a judge that reads the whole reaction would also extract. With the
    wish alone, a short reply of nonsense is distilled towards what the hint makes likelier —
    shorter still — though the person said it answered nothing; but on the length wish's five
    seeds the answer hint left sense level (0.42 of held-out replies either way; BENCHMARKS.md,
    issue 38's twenty-ninth pass), so "wish" stays, and earlier runs compare."""

    def __init__(self, serve: bool = True, nonsense_hint: str = "wish") -> None:
        if nonsense_hint not in NONSENSE_HINTS:
            raise ValueError(f"nonsense_hint must be one of {NONSENSE_HINTS}, not {nonsense_hint!r}")
        self.nonsense_hint = nonsense_hint
        super().__init__(serve=serve)

    def hint(self, next_state: str) -> str:
        """The correction less its opener ("No, that's not how I like it.") and its "Please try
        again: <task>": the wish in the person's words, as a judge's extracted hint is. Before
        2026-12-02 only a sentence beginning "Always" was taken, so for the length, lowercase and
        topic wishes the teacher read the whole reaction, the task asked again included
        (BENCHMARKS.md, issue 38's twenty-third pass)."""
        body = next_state.split(" Please try again:")[0]
        wish = " ".join(re.split(r"(?<=[.!?])\s+", body)[1:]) or next_state
        if self.nonsense_hint == "answer" and body.startswith(NOT_AN_ANSWER):
            return f"{ANSWER_HINT} {wish}"
        return wish


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
    from bench.learning import _first_token_probs
    from nextstate.judge.teacher import enhanced_messages

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
        kl_coef=args.kl_coef,
    )
    if getattr(args, "no_gate", False):
        tuned["publish_gate"] = False
    if getattr(args, "gate_max_repetition_rise", None) is not None:
        tuned["gate_max_repetition_rise"] = args.gate_max_repetition_rise
    if getattr(args, "gate_backtracks", None) is not None:
        tuned["gate_backtracks"] = args.gate_backtracks
    if getattr(args, "judge_fallback", None) is not None:
        tuned["judge_fallback"] = args.judge_fallback
    if getattr(args, "accepted_after_correction", None) is not None:
        tuned["accepted_after_correction"] = args.accepted_after_correction == "on"
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

    code = (base_model_readings, held_out_nll, reference_readings, sampled_texts, _sampled_for_each, _sampled_replies)
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


FINAL_SEED = 1_000_003  # the final evaluation's seeds: the same for every run, whatever --seed


async def _sampled_replies(turns, adapter, messages: list[dict], seeds: list[int], max_tokens: int,
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


async def _sampled_for_each(turns, adapter, tasks: list[str], n: int, max_tokens: int,
                            temperature: float) -> list[list[str]]:
    """`n` replies to each of `tasks` on the final evaluation's seeds, all submitted at once: the
    engine decodes them in batches of NEXTSTATE_MAX_CONCURRENT_GENERATIONS instead of `n` at a
    time (a version's held-out reading, 48 replies, took minutes question by question)."""
    return list(await asyncio.gather(*(
        _sampled_replies(turns, adapter, [{"role": "user", "content": task}], final_seeds(index, n, tasks),
                         max_tokens, temperature)
        for index, task in enumerate(tasks))))


def reading_timeout_s(replies: int) -> float:
    """How long a reading of `replies` sampled replies may take before the run gives up: all are
    one call now, and on two busy cores a batch of eight took over a minute (beside two runs)."""
    return 600.0 + 20.0 * replies


def sampled_texts(server, adapter: str | None, tasks: list[str], n: int, max_tokens: int,
                  temperature: float) -> list[list[str]]:
    """_sampled_for_each() from the bench's thread, with a time limit that grows with the replies."""
    return server.call(_sampled_for_each(server.app.state.services.turns, adapter, tasks, n, max_tokens, temperature),
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
GENERAL_TEXT = tuple(line for line in (Path(__file__).with_name("held_out_prose.txt").read_text(encoding="utf-8").splitlines())
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


def seeds_report(paths: list[str]) -> None:
    """Runs of several seeds grouped by preference and mode: the mean and spread (sample
    standard deviation) of first-reply success per window of WINDOW tasks, the updates needed
    to reach 0.8, the final evaluation's score, and text quality (repeated words, held-out
    perplexity against the base model's) — the table issue 38 asks for."""
    groups: dict[tuple[str, str, str], list[tuple[int, dict, dict]]] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        # runs of one setting differ only by seed: their variants by the "-seedN" suffix
        setting = re.sub(r"-seed\d+$", "", result.get("variant") or "")
        for run, summary in zip(result["runs"], result["summary"]):
            key = (result["preference"]["instruction"], summary["mode"], setting)
            groups.setdefault(key, []).append((result["settings"]["seed"], run, summary))

    def curve_of(curves: list[list[float]]) -> str:
        curves = [c for c in curves if c]
        return " · ".join(spread([c[i] for c in curves if i < len(c)]) for i in range(max(map(len, curves)))) \
            if curves else "—"

    print("| preference | mode | setting | seeds | success per window of 16 tasks (mean ± sd over seeds) "
          "| the same, sensible replies only | updates to 0.8 "
          "(per seed) | final version | final score | repeated words, final | perplexity, final / base "
          "| surprise to the base model, final (nats/token) | final score, sensible replies only "
          f"| held-out questions: base model → first version after {RATINGS} ratings (its ratings) → final "
          "| held-out final, sensible replies only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    pooled: list[dict] = []
    for (instruction, mode, setting), runs in groups.items():
        for _, run, _ in runs:
            pooled += figures_against_success(run["tasks"], run.get("steps", []), run.get("prose_forgetting"))
        # from the tasks: older result files have no summary of either
        curve = curve_of([by_window([t["score"] for t in run["tasks"]]) for _, run, _ in runs])
        sensible = curve_of([by_window(scores) for _, run, _ in runs if (scores := sensible_scores(run["tasks"]))])
        finals = [s["final"] for _, _, s in runs if s.get("final")]
        reached = [updates_to_reach(run["tasks"]) for _, run, _ in runs]
        reach = ", ".join("never" if r is None else str(r) for r in reached)
        versions = ", ".join(f"v{f['version']}" for f in finals)
        print(f"| {instruction} | {mode} | {setting or '—'} | {', '.join(str(seed) for seed, _, _ in runs)} | {curve} "
              f"| {sensible} | "
              f"{reach} | {versions} | {spread([f['score'] for f in finals])} | {spread([f.get('repetition') for f in finals])} | "
              f"{spread([f.get('perplexity_ratio') for f in finals])} | {spread([f.get('surprise') for f in finals])} | "
              f"{spread([f.get('score_sensible') for f in finals])} | {held_out_column(runs)} "
              f"| {spread([(f.get('held_out') or {}).get('score_sensible') for f in finals])} |")
    for (_, mode, setting), runs in groups.items():
        if (line := held_out_by_then(runs)) is not None:
            print(f"held-out questions, {setting or mode}: {line}")
    for figure in ("gain", "accepted", "rejected", "wish"):
        if (r := gain_correlation(pooled, figure)) is not None:
            versions = sum(1 for row in pooled if row.get(figure) is not None)
            print(f"held-out {figure} against measured success, over {versions} versions of these runs: Pearson's r = {r}")
    if (r := gain_correlation(pooled, "forgetting", "prose_forgetting")) is not None:
        versions = sum(1 for row in pooled if row.get("forgetting") is not None and row.get("prose_forgetting") is not None)
        print(f"the gate's forgetting against the bench's held-out prose, over {versions} versions: Pearson's r = {r}")


def spread(values: list[float | None]) -> str:
    """Mean ± sample standard deviation over seeds, the figures a run lacks left out ("—": none)."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ± {sd:.2f}"


def held_out_column(runs: list[tuple[int, dict, dict]]) -> str:
    """The held-out questions across a setting's seeds: the base model, the first version after
    RATINGS ratings (the ratings it had, per seed) and the final version ("—" for runs saved
    before the bench asked them)."""
    base = [s["held_out_by_version"][0]["score"] for _, _, s in runs if s.get("held_out_by_version")]
    after = [(row, run) for _, run, s in runs if (row := s.get("held_out_after_ratings"))]
    final = [f["held_out"]["score"] for _, _, s in runs if (f := s.get("final")) and f.get("held_out")]
    if not (base or after or final):
        return "—"
    counts = ", ".join(f"{row['ratings']}{updates_before(run, row['version'])}" for row, run in after)
    return f"{spread(base)} → {spread([row['score'] for row, _ in after])} ({counts or 'never'}) → {spread(final)}"


def held_out_by_then(runs: list[tuple[int, dict, dict]], ratings: int | None = None) -> str | None:
    """The stricter reading of "after about fifteen ratings": per seed the last version read
    after at most `ratings` ratings. The summary's first version after RATINGS can come
    ten ratings later on a seed whose updates fell just short of it, and flatter it; this one
    can stand for a version read after nine. Both are quoted (`ratings`: RATINGS + 2 unless
    given; None: no run read one)."""
    ratings = RATINGS + 2 if ratings is None else ratings
    read = [(seed, row) for seed, _, s in runs if (row := held_out_by(s.get("held_out_by_version") or [], ratings))]
    if not read:
        return None
    per_seed = ", ".join(f"{row['score']:.2f} (seed {seed}, v{row['version']}@{row['ratings']})" for seed, row in read)
    return f"the last version read after at most {ratings} ratings {spread([row['score'] for _, row in read])}: {per_seed}"


def updates_before(run: dict, version: int) -> str:
    """The published updates that made `version`, with the samples of each (" in 2 updates:
    8+6"; nothing for a run saved without its steps):
    an update moves the policy about as far whatever its batch (the KL brake and target set
    its length), so the ratings a reading follows say less than how many updates they made —
    and on this bench that depends on the machine's pace, partial batches training after
    NEXTSTATE_BATCH_WAIT_S."""
    if not run.get("steps"):
        return ""
    sizes = [str(s.get("samples", "?")) for s in run["steps"] if s.get("published") and s.get("version", 0) <= version]
    return f" in {len(sizes)} update{'s' if len(sizes) != 1 else ''}: {'+'.join(sizes) or '—'}"


def _places(value: float | None, places: int = 3) -> str:
    """A figure to `places` places, or a dash where it could not be measured (e.g. every reply too short)."""
    return "—" if value is None else f"{value:.{places}f}"


def report(paths: list[str]) -> None:
    """One line per run of saved results: what BENCHMARKS.md's tables quote."""
    print("| run | mode | score, first quarter → last | updates published / held back | repeated words, last quarter "
          f"| the same over the first {LENGTH_MATCHED_WORDS} words | words per reply, last quarter "
          "| final evaluation: version, score ± s.e., repeated words ± s.e. (replies) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        result = json.loads(Path(path).read_text())
        for run, s in zip(result["runs"], result["summary"]):
            last = run["tasks"][-max(1, len(run["tasks"]) // 4):]
            length = statistics.fmean(len(t["first_reply"].split()) for t in last)
            long_enough = sum(len(t["first_reply"].split()) >= LENGTH_MATCHED_WORDS for t in last)
            final = run.get("final")
            evaluated = "—"
            if final:
                # From the stored replies, so files saved before a figure existed report it too.
                samples = final["samples"]
                score_se = standard_error([r["score"] for r in samples])
                repetition_se = standard_error([repetition(r["first_reply"]) for r in samples])
                evaluated = (f"v{final['version']}, {_places(final['score'])} ± {_places(score_se)}, "
                             f"{_places(final['repetition'])} ± {_places(repetition_se)} ({final['replies']})")
            print(f"| {result.get('variant') or Path(path).stem} | {s['mode']} | {s['score_first_quarter']:.2f} → "
                  f"{s['score_last_quarter']:.3f} | {s['updates_published']} / {s['updates_skipped']} | "
                  f"{mean_repetition(last)} | {mean_repetition(last, LENGTH_MATCHED_WORDS)} ({long_enough} of {len(last)} replies) | {length:.1f} "
                  f"| {evaluated} |")


def figures_against_success(tasks: list[dict], steps: list[dict], prose: dict | None = None) -> list[dict]:
    """Per version (v0, the base model, included with gain and forgetting 0): what the learner
    measured on the held-out turns (learner/held_out.py) beside what the simulated user got
    from it — the mean first-reply success of the tasks that version answered — and, where the
    run read it, the version's forgetting on the bench's own held-out prose (`prose`)."""
    prose = {int(v): f for v, f in (prose or {}).items()}  # JSON keeps the versions as strings
    served: dict[int, list[float]] = {}
    for t in tasks:
        served.setdefault(t["version"], []).append(t["score"])
    figures = {0: {"gain": 0.0, "accepted": 0.0, "rejected": 0.0, "wish": 0.0, "forgetting": 0.0}}
    figures.update({s["version"]: s["figures"] for s in steps if s.get("published") and s.get("figures")})
    return [{"version": v, "gain": f.get("gain"), "accepted": f.get("accepted"), "rejected": f.get("rejected"),
             "wish": f.get("wish"), "forgetting": f.get("forgetting"), "held_out": f.get("held_out"),
             "success": round(statistics.fmean(served[v]), 3), "tasks": len(served[v]),
             "prose_forgetting": prose.get(v)}
            for v, f in sorted(figures.items()) if v in served]


def gain_correlation(rows: list[dict], figure: str = "gain", truth: str = "success") -> float | None:
    """Pearson's r between each version's held-out `figure` (gain, or its halves accepted and
    rejected) and its measured `truth` (success; or the bench's prose forgetting against the
    gate's), None under three versions or with no spread in either."""
    pairs = [(r[figure], r[truth]) for r in rows if r.get(figure) is not None and r.get(truth) is not None]
    if len(pairs) < 3 or len({g for g, _ in pairs}) < 2 or len({s for _, s in pairs}) < 2:
        return None
    return round(statistics.correlation([g for g, _ in pairs], [s for _, s in pairs]), 3)


# "A person's stated wish visible on held-out questions after about fifteen ratings."
RATINGS = 15


def held_out_after(rows: list[dict], ratings: int = RATINGS) -> dict | None:
    """The first version that began serving after at least `ratings` ratings, as read on the
    held-out questions (`rows`: held_out_by_version); None if the run never got that far."""
    return next((r for r in rows if r["ratings"] >= ratings and r["version"] > 0), None)


def held_out_by(rows: list[dict], ratings: int) -> dict | None:
    """The last version read after at most `ratings` ratings (held_out_after's stricter twin);
    None if none was read by then."""
    return next((r for r in reversed(rows) if r["version"] > 0 and r["ratings"] <= ratings), None)


def without_samples(final: dict) -> dict:
    """The final evaluation's figures without the replies themselves (the summary's copy)."""
    out = {k: v for k, v in final.items() if k != "samples"}
    if isinstance(out.get("held_out"), dict):
        out["held_out"] = {k: v for k, v in out["held_out"].items() if k != "samples"}
    return out


def summarise(run: ModeRun) -> dict:
    scores = [t.score for t in run.tasks]
    by_version: dict[str, list[float]] = {}
    for t in run.tasks:
        bucket = "v0" if t.version == 0 else f"v{1 + 4 * ((t.version - 1) // 4)}-{4 + 4 * ((t.version - 1) // 4)}"
        by_version.setdefault(bucket, []).append(t.score)
    quarter = max(1, len(scores) // 4)
    return {
        "mode": run.mode,
        "tasks": len(scores),
        "score_first_quarter": round(statistics.fmean(scores[:quarter]), 3),
        "score_last_quarter": round(statistics.fmean(scores[-quarter:]), 3),
        "repetition_first_quarter": mean_repetition([asdict(t) for t in run.tasks[:quarter]]),
        "repetition_last_quarter": mean_repetition([asdict(t) for t in run.tasks[-quarter:]]),
        "repetition_last_quarter_length_matched": mean_repetition([asdict(t) for t in run.tasks[-quarter:]],
                                                                  LENGTH_MATCHED_WORDS),
        "updates_published": sum(1 for s in run.steps if s.get("published")),
        "updates_skipped": sum(1 for s in run.steps if not s.get("published")),
        "updates_to_0_8": updates_to_reach([asdict(t) for t in run.tasks]),
        "score_by_window": by_window(scores),
        "score_sensible_by_window": (sensible := sensible_scores([asdict(t) for t in run.tasks])) and by_window(sensible),
        "score_by_serving_version": {k: {"score": round(statistics.fmean(v), 3), "tasks": len(v)} for k, v in by_version.items()},
        "final": run.final and without_samples(run.final),
        "held_out_by_version": [{"version": v} | r for v, r in sorted(run.held_out.items())],
        "held_out_after_ratings": held_out_after([{"version": v} | r for v, r in sorted(run.held_out.items())]),
        "versions": (rows := figures_against_success([asdict(t) for t in run.tasks], run.steps, run.prose_forgetting)),
        "gain_vs_success": gain_correlation(rows),
    }


def headline(result: dict) -> str:
    parts = []
    for run, s in zip(result["runs"], result["summary"]):
        quarter = max(1, len(run["tasks"]) // 4)
        parts.append(f"{s['mode']} {s['score_first_quarter']:.2f}→{s['score_last_quarter']:.2f} "
                     f"({s['updates_published']} upd., repeated words {_places(mean_repetition(run['tasks'][:quarter]), 2)}→"
                     f"{_places(mean_repetition(run['tasks'][-quarter:]), 2)})")
        if run.get("final"):
            final = run["final"]
            parts[-1] += (f", final evaluation of v{final['version']}: {final['score']:.2f}, "
                          f"repeated words {_places(final['repetition'], 2)}"
                          + (f", surprise {final['surprise']:.2f} nats/token" if final.get("surprise") is not None else "")
                          + f" ({final['replies']} replies)")
            if final.get("held_out"):
                held = final["held_out"]
                parts[-1] += f", held-out questions {held['score']:.2f}" + (
                    f" ({held['score_sensible']:.2f} with sense)" if held.get("score_sensible") is not None else "")
        if (after := s.get("held_out_after_ratings")) and s.get("held_out_by_version"):
            parts[-1] += (f", held-out {s['held_out_by_version'][0]['score']:.2f} → {after['score']:.2f} "
                          f"after {after['ratings']} ratings (v{after['version']})")
    return "first-reply score, first → last quarter of tasks: " + ", ".join(parts)


def plot(result: dict, window: int = 16):
    plt = pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4))

    def smooth(values: list[float]) -> tuple[range, list[float]]:
        return range(window, len(values) + 1), [statistics.fmean(values[i - window + 1: i + 1])
                                                for i in range(window - 1, len(values))]

    for run in result["runs"]:
        ax.plot(*smooth([t["score"] for t in run["tasks"]]), label=run["mode"])
        versions = sorted({t["version"] for t in run["tasks"]})
        bx.plot(versions, [statistics.fmean(t["score"] for t in run["tasks"] if t["version"] == v) for v in versions],
                "o-", markersize=3, label=run["mode"])
        if held := run.get("held_out"):  # JSON keeps the versions as strings
            rows = sorted((int(v), r["score"]) for v, r in held.items())
            bx.plot([v for v, _ in rows], [score for _, score in rows], "s--", markersize=3,
                    label=f"{run['mode']}, held-out questions")
        repeats = [r for r in (repetition(t["first_reply"]) for t in run["tasks"]) if r is not None]
        cx.plot(*smooth(repeats), label=run["mode"])
    ax.set_xlabel("fresh tasks (interactions)")
    ax.set_ylabel(f"score of the first reply (mean of last {window})")
    bx.set_xlabel("policy version serving the first reply (= updates)")
    bx.set_ylabel("mean score of the first replies it served")
    for axis in (ax, bx):
        axis.set_ylim(-0.02, 1.02)
    cx.set_xlabel("fresh tasks (interactions)")
    cx.set_ylabel(f"repeated words in the first reply (mean of last {window})")
    cx.set_ylim(bottom=0)
    for axis in (ax, bx, cx):
        axis.legend()
    settings = result["settings"]
    fig.suptitle(f"{result['model']}: \"{result['preference']['instruction']}\" ({settings['tasks']} tasks per mode, "
                 f"batch {settings['batch']}, lr {settings['lr']}, KL {settings.get('kl_coef', 0.0)})", fontsize=10)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", help="any local HF model dir (default: a peaked tiny model)")
    parser.add_argument("--smol", action="store_true", help="the embedded SmolLM2 as the policy")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tasks", type=int, default=160, help="fresh tasks per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rule", help="rule-checked preference: capital, digit, marker:WORD or marker:auto "
                        "(default: capital on the tiny model, marker:auto otherwise, none with --preference)")
    parser.add_argument("--kind", choices=sorted(KINDS), help="a preference kind by name (sets --rule): " + ", ".join(
        f"{k} = {v}" for k, v in KINDS.items()))
    parser.add_argument("--target", type=float, default=0.15, help="marker:auto picks the word with this base probability")
    parser.add_argument("--preference", help="the preference in words (needed with a model user/scorer)")
    parser.add_argument("--sensible-user", action="store_true",
                        help="the user also turns down a reply the base model reads as nonsense (surprise over "
                             f"{SENSIBLE_SURPRISE:g} nats/token, bench/reply_surprise.py): \"{NOT_AN_ANSWER} ...\"")
    parser.add_argument("--nonsense-hint", choices=NONSENSE_HINTS, default="wish",
                        help="the rule judge's hint for a reply turned down as nonsense: the wish's sentence alone "
                             f"(wish), or \"{ANSWER_HINT}\" before it (answer)")
    parser.add_argument("--max-attempts", type=int, default=2, help="replies per task before the user moves on")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--think-s", type=float, default=0.3, help="pause after each task")
    parser.add_argument("--final-samples", type=int, default=16,
                        help="replies sampled per task from the final version, to score the run (0: none)")
    parser.add_argument("--questions", choices=sorted(QUESTIONS), default=None,
                        help="the questions asked and held out (default: the kind's, else everyday)")
    parser.add_argument("--held-out-samples", type=int, default=2,
                        help=f"replies sampled per held-out question ({len(HELD_OUT_TASKS)} questions the user never "
                             "asks) from each version as it begins serving (0: none)")
    parser.add_argument("--defaults", action="store_true",
                        help="every server setting at its default (batch, lr, LoRA, KL, votes): what a newcomer gets")
    parser.add_argument("--feedback", action="store_true",
                        help="the user also rates every reply with POST /v1/feedback (a correction when it misses); "
                             "without --judge-url the server's own default judge is kept (the served model)")
    parser.add_argument("--served-judge", action="store_true",
                        help="the server's own default judge (the served model; benched when it fails its check, "
                             "then next states teach as hints: NEXTSTATE_JUDGE_FALLBACK) instead of the rule judge")
    parser.add_argument("--judge-fallback", choices=("hindsight", "ratings"), default=None,
                        help="NEXTSTATE_JUDGE_FALLBACK (default: the setting's default)")
    parser.add_argument("--accepted-after-correction", choices=("on", "off"), default=None,
                        help="NEXTSTATE_ACCEPTED_AFTER_CORRECTION (default: the server's, on): the ablation's switch")
    parser.add_argument("--fresh-base", action="store_true",
                        help="read the base model again instead of taking its readings from the cache "
                             "(bench/base_cache.py: kept by model, engine, parameters and source)")
    parser.add_argument("--wait-for-learner", action="store_true",
                        help="after each task, wait until the learner trained every full batch: updates per task "
                             "fixed by the batch size, not by the machine's speed")
    parser.add_argument("--learner-wait-s", type=float, default=LEARNER_WAIT_S,
                        help="--wait-for-learner gives up after this many seconds (a stuck learner)")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                        help="any server setting by name, e.g. --set minibatch_size=4 (repeatable)")
    parser.add_argument("--no-gate", action="store_true", help="NEXTSTATE_PUBLISH_GATE=false: every update serves")
    parser.add_argument("--gate-max-repetition-rise", type=float, default=None,
                        help="NEXTSTATE_GATE_MAX_REPETITION_RISE (default: the setting's default)")
    parser.add_argument("--gate-backtracks", type=int, default=None,
                        help="NEXTSTATE_GATE_BACKTRACKS (default: the setting's default)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lora-r", type=int, default=None)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="NEXTSTATE_KL_COEF: the reverse-KL anchor to the base model")
    parser.add_argument("--votes", type=int, default=1, help="judge votes per turn (the rule judge always agrees)")
    for role in ("user", "judge", "scorer"):
        parser.add_argument(f"--{role}-url", help=f"OpenAI-compatible endpoint for the {role} (default: rules)")
        parser.add_argument(f"--{role}-model", default="default")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY")
    parser.add_argument("--variant", help="a name for this run's settings: its results get their own file")
    parser.add_argument("--stop-after-min", type=float, default=None, metavar="MINUTES",
                        help="end the tasks at the first task boundary after this long (SIGTERM does too): the "
                             "final evaluation runs and the result is written, with `stopped_after` the tasks done")
    parser.add_argument("--sglang-url", help="serve the policy from this SGLang server (deploy/) instead of in-process")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print saved results as a table and exit")
    parser.add_argument("--seeds-report", nargs="+", metavar="JSON",
                        help="print runs of several seeds, grouped by preference and mode, as curves with spread")
    parser.add_argument("--reread", nargs="+", metavar="JSON",
                        help="add the surprise figure (bench/reply_surprise.py) to saved SmolLM2 results and exit")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if args.seeds_report:
        seeds_report(args.seeds_report)
        return
    if args.reread:
        reread(args.reread)
        return

    policy = bench_model(model=args.policy, smol=args.smol, peaked=True)
    tiny = not (args.policy or args.smol)
    args.max_tokens = args.max_tokens or (8 if tiny else 48)
    if args.defaults:  # what the server does with no NEXTSTATE_* variable set, for the record
        defaults = LearnerSettings()
        args.batch, args.lr, args.lora_r, args.kl_coef = defaults.batch_size, defaults.lr, defaults.lora_r, defaults.kl_coef
        args.votes = JudgeSettings().prm_votes
    # A --set of a setting the result records is what the run had (it wins over the flags above).
    for name, value in overrides(args.set).items():
        if field := {"batch_size": "batch", "lora_r": "lora_r", "prm_votes": "votes"}.get(name):
            setattr(args, field, int(value))
        elif name in ("lr", "kl_coef"):
            setattr(args, name, value if value == "auto" else float(value))
    args.lr = args.lr or (5e-3 if tiny else 2e-4)
    args.lora_r = args.lora_r or (8 if tiny else 16)
    api_key = os.environ.get(args.api_key_env)

    marker_probability = None
    if args.kind:
        args.rule = KINDS[args.kind]
    args.questions = args.questions or KIND_QUESTIONS.get(args.kind, "everyday")
    rule = args.rule if args.rule is not None else ("" if args.preference else "capital" if tiny else "marker:auto")
    if rule.startswith("marker:"):
        wanted = rule.removeprefix("marker:")
        marker, plain, hinted = probe_marker(policy, engine_settings(args), None if wanted == "auto" else wanted,
                                             args.target)
        rule = f"marker:{marker}"
        marker_probability = {"first_token": round(plain, 4), "first_token_with_hint": round(hinted, 4)}
        print(f"preference marker: {marker!r}, mean first-token probability {plain:.3f}, {hinted:.3f} with the hint")
    instruction = args.preference or instruction_for(rule)
    if instruction is None:
        raise SystemExit(f"unknown --rule {rule!r}: use capital, digit, short, lowercase, nolist, avoid:WORDS, "
                         "marker:WORD or marker:auto")
    preference = Preference(instruction, rule)
    user = ModelUser(ChatModel(args.user_url, args.user_model, api_key), preference) if args.user_url else RuleUser(preference)
    scorer = (ModelScorer(ChatModel(args.scorer_url, args.scorer_model, api_key), preference) if args.scorer_url
              else RuleScorer(preference))
    rule_judge = None
    if args.judge_url:
        judge = {"judge_base_url": args.judge_url, "judge_model": args.judge_model, "judge_api_key": api_key}
    elif args.feedback or args.served_judge:
        judge = {}  # the default: the served model judges, and must pass its calibration first
    else:
        rule_judge = PreferenceJudge(nonsense_hint=args.nonsense_hint)
        judge = {"judge_base_url": rule_judge.base_url, "judge_model": "rules"}

    tasks = task_list(args.seed, args.tasks, questions_of(args).asked)
    result = {
        "benchmark": "personalization",
        "model": policy.name,
        "variant": args.variant,
        "preference": asdict(preference),
        "questions": args.questions,
        "marker_probability": marker_probability,
        "user": (args.user_url and f"{args.user_model} at {args.user_url}" or "rules") + (
            f", turning down nonsense (surprise > {SENSIBLE_SURPRISE:g})" if args.sensible_user else ""),
        "judge": args.judge_url and f"{args.judge_model} at {args.judge_url}" or (
            "the default (the served model itself)" if args.feedback or args.served_judge else "rules (PreferenceJudge)"),
        "judge_fallback": args.judge_fallback or JudgeSettings().judge_fallback,
        "hindsight_contrast": overrides(args.set).get("hindsight_contrast", JudgeSettings().hindsight_contrast),
        "hint_contrast": overrides(args.set).get("hint_contrast", JudgeSettings().hint_contrast),
        "accepted_after_correction": (args.accepted_after_correction == "on" if args.accepted_after_correction
                                      else JudgeSettings().accepted_after_correction),
        "overrides": overrides(args.set),
        "explicit_feedback": args.feedback,
        "publish_gate": not args.no_gate,
        "gate_max_repetition_rise": None if args.no_gate else (
            args.gate_max_repetition_rise if args.gate_max_repetition_rise is not None else LearnerSettings().gate_max_repetition_rise),
        "gate_backtracks": None if args.no_gate else (
            args.gate_backtracks if args.gate_backtracks is not None else LearnerSettings().gate_backtracks),
        "gate_prompts": GATE_PROMPTS,
        "scorer": args.scorer_url and f"{args.scorer_model} at {args.scorer_url}" or "rules",
        "settings": {k: getattr(args, k) for k in ("tasks", "seed", "max_attempts", "max_tokens", "temperature", "think_s",
                                                    "batch", "lr", "lora_r", "kl_coef", "votes", "final_samples",
                                                    "wait_for_learner", "sensible_user", "held_out_samples", "nonsense_hint")},
        "summary": [],
        "runs": [],
    }
    stop = StopRequest(args.stop_after_min)
    stop.install()
    try:
        for mode in args.modes:
            if stop.requested:
                print(f"{mode:>8}: not run (stop requested)", flush=True)
                continue
            run = run_mode(mode, policy, tasks, args, judge, user, scorer, stop)
            summary = summarise(run)
            print(f"{mode:>8}: score {summary['score_first_quarter']:.2f} (first quarter) -> "
                  f"{summary['score_last_quarter']:.2f} (last quarter), {summary['updates_published']} updates")
            result["summary"].append(summary)
            result["runs"].append({"mode": run.mode, "steps": run.steps, "calibration": run.calibration,
                                   "tasks": [asdict(t) for t in run.tasks], "final": run.final,
                                   "prose_forgetting": run.prose_forgetting, "held_out": run.held_out,
                                   "stopped_after": run.stopped_after})
            save(result)  # after every mode: an interrupted run keeps the modes it finished
    finally:
        if rule_judge is not None:
            rule_judge.stop()


if __name__ == "__main__":
    main()
