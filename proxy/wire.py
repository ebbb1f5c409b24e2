"""What every API's request model shares: strict types with unknown fields let through, and
nextstate's own session fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nextstate.proxy.sessions import SESSION_ID_PATTERN


class OpenModel(BaseModel):
    # Strict like the APIs it mirrors: "stream": "yes" or "max_tokens": "5" is an error, not a
    # guess; unknown fields pass (clients add vendor extras).
    model_config = ConfigDict(extra="allow", strict=True)


class SessionFields(OpenModel):
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
