"""What every API's request shares: strict types with unknown fields let through, and
nextstate's own session hints, as body fields or headers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nextstate.proxy.errors import invalid_request
from nextstate.proxy.sessions import SESSION_ID_PATTERN
from nextstate.core.agent_texts import coding_agent, harness_turn_type

_TRUE = {"1", "true", "yes", "on"}


class ExtraAllowedModel(BaseModel):
    """A request model: strict types, unknown fields allowed."""

    # Strict like the APIs it mirrors: "stream": "yes" or "max_tokens": "5" is an error, not a
    # guess; unknown fields pass (clients add vendor extras).
    model_config = ConfigDict(extra="allow", strict=True)


class JsonSchemaSpec(ExtraAllowedModel):
    """A structured reply's schema as both OpenAI APIs name it: chat's
    `response_format.json_schema`, Responses' `text.format` (modelio/structured_output.py)."""

    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class SessionFields(ExtraAllowedModel):
    """nextstate's extensions of a request body, also accepted as the X-Session-Id,
    X-Turn-Type, X-Session-Done and X-Outcome-Expected headers (which win)."""

    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None
    outcome_expected: bool | None = None


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool in chat completions' shape, the one every template and the session chain see."""
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class TurnHints:
    """What the client said about the session, via headers or body fields."""

    session_id: str | None = None
    turn_type: str | None = None
    done: bool = False
    outcome_expected: bool = False
    agent: str | None = None  # the coding agent its User-Agent names (core/agent_texts.py), if any

    @classmethod
    def from_request(cls, headers: Any, body: Any) -> TurnHints:
        """Headers win over the body's nextstate extension fields (`session_id`, ...)."""
        turn_type = headers.get("x-turn-type") or getattr(body, "turn_type", None) or harness_turn_type(headers)
        if turn_type is not None:
            turn_type = turn_type.strip().lower()
            if turn_type not in ("main", "side"):
                raise invalid_request("X-Turn-Type must be 'main' or 'side'.", param="X-Turn-Type")
        session_id = headers.get("x-session-id") or getattr(body, "session_id", None)
        if session_id is not None:
            session_id = session_id.strip()
            if not re.fullmatch(SESSION_ID_PATTERN, session_id):
                raise invalid_request(
                    "X-Session-Id must be 1-200 visible ASCII characters (no spaces or control characters).",
                    param="X-Session-Id",
                )
        done = _flag(headers.get("x-session-done"), getattr(body, "session_done", None))
        outcome = _flag(headers.get("x-outcome-expected"), getattr(body, "outcome_expected", None))
        return cls(session_id or None, turn_type, done, outcome, coding_agent(headers.get("user-agent")))


def _flag(header: str | None, field_value: bool | None) -> bool:
    return header.strip().lower() in _TRUE if header is not None else bool(field_value)
