"""Server-sent events as OpenAI-compatible clients read them: `data: <json>` lines, `[DONE]`."""

from __future__ import annotations

import json
from typing import Any


def sse_event(payload: str | dict[str, Any]) -> str:
    """One event; a dict is serialised, a string is taken as JSON already."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def sse_comment(text: str = "keep-alive") -> str:
    """A comment line: clients ignore it, proxies and sockets see the stream is alive."""
    return f": {text}\n\n"
