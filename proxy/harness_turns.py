"""Requests an agent sends for itself: a memory flush, a compaction summary.

An agent's own housekeeping arrives through the same endpoint as its person's messages.
OpenClaw, near the end of its context, first asks the model to flush durable memories to a file
(as the last user message of the same conversation) and then to summarise the history (fresh
two-message requests with a summariser's system prompt). Taken as main turns, the flush would
become the person's reaction to the reply before it, and every summary a session of its own.
They are served as side turns instead: answered and recorded, never a next state, never a
session, never trained (`NEXTSTATE_HARNESS_TURNS`, OpenClaw 2026.9's texts by default).
"""

from __future__ import annotations

import re
from typing import Any


class HarnessTurns:
    """Whether a request is the agent's own: its system prompt or its last user message matches
    one of the patterns."""

    def __init__(self, patterns: list[str] | tuple[str, ...] = ()) -> None:
        self.patterns = [re.compile(p) for p in patterns]

    def matches(self, messages: list[dict[str, Any]]) -> bool:
        if not self.patterns or not messages:
            return False
        # the request's messages are normalised: text content, a developer message as system;
        # its system prompt, and the user message it ends with (what is asked)
        first, last = messages[0], messages[-1]
        ends = [m for m, role in ((first, "system"), (last, "user")) if m.get("role") == role]
        texts = [str(m.get("content") or "") for m in ends]
        return any(p.search(text) for p in self.patterns for text in texts)
