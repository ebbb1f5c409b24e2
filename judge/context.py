"""What the judge gets to see of a turn: the request, the response, the next state.

The reference judge saw only the response and the next state, which makes it myopic (a
"thanks" can't be told from sarcasm without the question). We show the request and a
bounded slice of history too, each text cut to a budget so a long agent prompt cannot
overflow a small judge's context.
"""

from __future__ import annotations

from typing import Any

from nextstate.types import NextState, Turn
from proxy.chat_template import tool_call_text


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = max(1, limit // 2 - 10)
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def message_text(message: dict[str, Any]) -> str:
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        text += ("\n" if text else "") + tool_call_text(fn.get("name", ""), fn.get("arguments", {}))
    return text


def prompt_values(turn: Turn, next_state: NextState, max_chars: int) -> dict[str, str]:
    messages = turn.messages
    last_request = next((m for m in reversed(messages) if m["role"] in ("user", "tool")), None)
    first_user = next((m for m in messages if m["role"] == "user"), None)
    history_msgs = [m for m in messages if m["role"] != "system" and m is not last_request]
    history = "\n".join(f"[{m['role']}] {message_text(m)}" for m in history_msgs)
    return {
        "task": _clip(message_text(first_user) if first_user else "", max_chars),
        "history": _clip(history, max_chars) or "(none)",
        "request": _clip(message_text(last_request) if last_request else "", max_chars),
        "response": _clip(message_text(turn.response_message), max_chars),
        "next_state_role": next_state.role,
        "next_state": _clip("\n\n".join(message_text(m) for m in next_state.messages), max_chars),
    }
