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
base model's own replies read −4.5 nats at their first token, −2.8 over 16): a wish for short
replies must not read as strangeness by itself. The stop token is left out, so a reply ending
early is not counted against it either — the wish asks for that.
"""

from __future__ import annotations

import statistics

# Base-model replies per question that are the reference (the final evaluation's first seeds).
REFERENCE_REPLIES = 2


def reading(server, task: str, reply: str) -> list[float]:
    """The base model's log-probability of each token of `reply` as the answer to `task`."""
    turns = server.app.state.services.turns
    prompt = turns.renderer.render([{"role": "user", "content": task}]).ids
    ids = turns.renderer.tokenizer.encode(reply, add_special_tokens=False)
    if not ids:
        return []
    return server.call(turns.engine.score(prompt + ids, len(prompt), adapter=None), timeout=600)


def surprise(replies: list[tuple[str, list[float]]], reference: dict[str, list[list[float]]]) -> dict:
    """Mean surprise of `replies` ((question, base reading) pairs) over the base model's own
    replies to each question (`reference`: their readings), each reference cut to the reply's
    length; with its standard error over replies. Empty replies are left out (the bench counts
    them apart)."""
    per_reply = []
    for task, read in replies:
        own = [r for r in reference.get(task, []) if r]
        if not read or not own:
            continue
        expected = statistics.fmean(statistics.fmean(r[:len(read)]) for r in own)
        per_reply.append(expected - statistics.fmean(read))
    if not per_reply:
        return {"surprise": None, "surprise_stderr": None, "surprise_replies": 0}
    error = statistics.stdev(per_reply) / len(per_reply) ** 0.5 if len(per_reply) > 1 else None
    return {"surprise": round(statistics.fmean(per_reply), 3),
            "surprise_stderr": None if error is None else round(error, 3),
            "surprise_replies": len(per_reply)}
