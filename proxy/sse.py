"""Server-sent events as the three APIs' clients read them: `data: <json>` lines (Chat
Completions, ending in `[DONE]`), and named events, `event: <type>` before the data (Anthropic's
Messages and OpenAI's Responses)."""

from __future__ import annotations

import json
from typing import Any


def sse_event(payload: str | dict[str, Any], name: str | None = None) -> str:
    """One event; a dict is serialised, a string is taken as JSON already. `name`: the event
    type line the Messages and Responses streams put before each event."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def sse_comment(text: str = "keep-alive") -> str:
    """A comment line: clients ignore it, proxies and sockets see the stream is alive."""
    return f": {text}\n\n"
