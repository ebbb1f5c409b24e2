"""How strange a version's replies read to the base model: a quality figure the rule scorers miss.

The personalization bench scores a reply by the wish alone ("at most twelve words", "begins
with 'The'"), and its text-quality figures — repeated words, perplexity on held-out prose —
read the version's own text or a fixed text. None of them sees a version that meets the wish
with nonsense: the length wish at 0.86 on three seeds (2026-11-27) answered "Ladle.", "SmolMLO."
and "baedaaaahahahahaoorrrriddinasssung lol" to everyday questions.

The figure here is the base model's mean log-probability per token of each reply, given its
question, against that of the base model's own replies to the same question (sampled on the
same seeds), cut to the same length: **surprise**, in nats per token, 0 for replies like the
base model's own. Length-matched because a reply's first tokens are the least predictable (the
base model's own replies read about −4.5 nats at their first token, −2.8 over 16): a wish for short
replies must not read as strangeness by itself. The stop token is left out, so a reply ending
early is not counted against it either — the wish asks for that.
"""

from __future__ import annotations

import statistics

# Base-model replies per question that are the reference (the final evaluation's first seeds).
REFERENCE_REPLIES = 2
# A reply that fits the wish counts as sensible only if it reads at most this much worse than
# the base model's own (nats per token). Over the 96-task runs' replies (2026-11-27): one of the
# base model's own replies in ten reads worse than this, 4-6% of the opening word's fluent runs,
# 25-60% of the length wish's runs at 0.86.
SENSIBLE_SURPRISE = 2.0


def reading(server, task: str, reply: str) -> list[float]:
    """The base model's log-probability of each token of `reply` as the answer to `task`."""
    turns = server.app.state.services.turns
    prompt = turns.renderer.render([{"role": "user", "content": task}]).ids
    ids = turns.renderer.tokenizer.encode(reply, add_special_tokens=False)
    if not ids:
        return []
    return server.call(turns.engine.score(prompt + ids, len(prompt), adapter=None), timeout=600)


def reply_surprise(read: list[float], own: list[list[float]]) -> float | None:
    """How much less likely the base model finds a reply (`read`: its log-probability of each
    token) than its own replies to the same prompt (`own`), each cut to the reply's length, in
    nats per token; None for an empty reply. Cut, because a reply's first tokens are the least
    predictable (SmolLM2's own replies read about -4.5 nats at their first token, -2.8 over
    sixteen): a short reply is compared with the start of the base model's, so brevity is not
    strangeness."""
    own = [o for o in own if o]
    if not read or not own:
        return None
    expected = sum(sum(o[:len(read)]) / len(o[:len(read)]) for o in own) / len(own)
    return expected - sum(read) / len(read)


def of_reply(task: str, read: list[float], reference: dict[str, list[list[float]]]) -> float | None:
    """One reply's surprise: its base reading `read` against the base model's own replies to
    `task` (`reference`: their readings); None for an empty reply or an unknown question."""
    return reply_surprise(read, reference.get(task, []))


def surprise(replies: list[tuple[str, list[float]]], reference: dict[str, list[list[float]]],
             scores: list[float] | None = None) -> dict:
    """The mean surprise of `replies` ((question, base reading) pairs) over the base model's own
    replies to each question (`reference`: their readings, learner/gate.py `surprise`), with its
    standard error over replies; an empty reply or an unknown question has none. With the wish's
    `scores` of the same replies, also `score_sensible`: the share that fit the wish and read no
    stranger than SENSIBLE_SURPRISE (an empty reply is not sensible)."""
    each = [of_reply(task, read, reference) for task, read in replies]
    present = [x for x in each if x is not None]
    figures: dict = {"surprise": None, "surprise_stderr": None, "surprise_replies": len(present)}
    if present:
        figures["surprise"] = round(statistics.fmean(present), 3)
        if len(present) > 1:
            figures["surprise_stderr"] = round(statistics.stdev(present) / len(present) ** 0.5, 3)
    if scores is not None and each:
        figures["score_sensible"] = round(statistics.fmean(
            score if x is not None and x <= SENSIBLE_SURPRISE else 0.0 for score, x in zip(scores, each)), 3)
    return figures
