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
"""

from __future__ import annotations

from nextstate.core.types import NextState
from nextstate.judge.context import Unwrap, clip_text, message_text

# How a next state reads as a hint, by the role of its message.
LEADS = {"user": "The user answered this reply with: ", "tool": "The tool call returned: "}


def hindsight_hint(next_state: NextState, max_chars: int, unwrap: Unwrap | None = None) -> str | None:
    """The next state as a hint for the OPD teacher, or None when it holds no words to learn
    from (an empty message, or only the assistant's own)."""
    unwrap = unwrap or Unwrap()
    parts = []
    for message in next_state.messages:
        lead = LEADS.get(str(message.get("role")))
        text = unwrap(message_text(message)).strip() if lead else ""
        if text:
            parts.append(lead + text)
    return clip_text("\n".join(parts), max_chars) if parts else None
