"""Hindsight without a judge: the next state itself as the OPD hint.

The method's core is that what a person says next teaches the reply before it. With a judge
that fails its start-up check (the embedded SmolLM2 does: judge/calibration.py) there is no
vote and no extracted hint, and a laptop user with no second model used to learn from nothing
but explicit ratings. Yet the OPD teacher needs no judge to read: it is the served base model
scoring the same reply under a prompt that knows something more. Here that something is the
next state in its own words — "the user answered this reply with: No, in one sentence please"
— so the teacher's logprobs say, token by token, which parts of the reply the person's reaction
makes less (or more) likely. This is hindsight relabelling of the OPD kind (the paper's §4.2
hint is a judge's summary of the same next state) with the judge taken out: noisier per turn,
but a correction written as an instruction ("Answer in one short sentence.") is already the
hint a judge would extract, and a plain "thanks" raises what was liked.

Only the person's words and tool results are used; an agent's own notices never reach here
(judge/service.py handles them first) and its wrappers are removed (`Unwrap`).

**The placebo** (`hindsight_placebo`, NEXTSTATE_HINDSIGHT_CONTRAST=placebo, the default). The
shift the learner distils is what the hint changes in the base model. Measured against the
prompt without the hint, that change holds the hint's meaning *and* the bare presence of its
words, which a small model copies: on SmolLM2, next states alone taught the length wish to
0.50 with replies that echoed the person ("No, that response was not answered.", BENCHMARKS.md,
twelfth pass). So the shift is measured against the same hint with the words of the next state
in a shuffled order: the same words present, their sentence gone. What copying adds cancels;
what the sentence says stays — so a next state of one word ("Thanks!", "No.") is its own
placebo and teaches nothing here; a rating teaches it. Sampled from the compounded shift (bench/hindsight_echo.py),
replies that echo the reaction went 0.75-1.00 → 0.00-0.17 and read as the base model's own;
trained on next states alone over three seeds, the length wish ended at 0.62 ± 0.09 with 0.01-
0.05 of replies echoing, against 0.50-0.55 and 0.73-1.00 measured against the prompt (the
defaults of 2026-11-28; at those of 2026-12-02, 0.56 ± 0.11 of held-out replies after 30-42
next states, nearly all of them sensible).
"""

from __future__ import annotations

import random

from nextstate.core.types import NextState
from nextstate.judge.context import Unwrap, clip_text, message_text

# How a next state reads as a hint, by the role of its message.
LEADS = {"user": "The user answered this reply with: ", "tool": "The tool call returned: "}


def _parts(next_state: NextState, unwrap: Unwrap | None) -> list[tuple[str, str]]:
    """(lead, words) of each message of the next state that teaches."""
    unwrap = unwrap or Unwrap()
    parts = []
    for message in next_state.messages:
        lead = LEADS.get(str(message.get("role")))
        text = unwrap(message_text(message)).strip() if lead else ""
        if text:
            parts.append((lead, text))
    return parts


def hindsight_hint(next_state: NextState, max_chars: int, unwrap: Unwrap | None = None) -> str | None:
    """The next state as a hint for the OPD teacher, or None when it holds no words to learn
    from (an empty message, or only the assistant's own)."""
    parts = _parts(next_state, unwrap)
    return clip_text("\n".join(lead + text for lead, text in parts), max_chars) if parts else None


def hindsight_placebo(next_state: NextState, max_chars: int, unwrap: Unwrap | None = None) -> str | None:
    """The hint's placebo: the same leads, each message's words shuffled (the same way every
    time for the same words: a sample judged twice gets one placebo), or None as the hint."""
    parts = _parts(next_state, unwrap)
    return clip_text("\n".join(lead + scrambled(text) for lead, text in parts), max_chars) if parts else None


def scrambled(text: str) -> str:
    """`text`'s words in an order drawn from the text itself."""
    words = text.split()
    random.Random(text).shuffle(words)
    return " ".join(words)
