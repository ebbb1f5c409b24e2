"""The simulated person and the rules that judge them: the questions they ask, the wish they hold
(a `Preference`), how they react to a reply, and the judge that reads their reactions exactly."""

from __future__ import annotations

import re
from dataclasses import dataclass

from openai import OpenAI

from bench.reply_surprise import SENSIBLE_SURPRISE
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
