"""Anthropic's Messages API: the request nextstate accepts, and its conversion to a turn.

Claude-style agents send `POST /v1/messages` with a top-level `system`, messages whose content
is a string or blocks (`text`, `tool_use`, `tool_result`), tools with an `input_schema`, and a
required `max_tokens`. `MessagesRequest.to_turn_messages` turns that into the OpenAI chat shape
every other path of nextstate speaks (system message, assistant `tool_calls`, `tool` messages),
so a Messages conversation is rendered, matched to its session, judged and trained exactly as
the same conversation through chat completions would be.

As for chat completions, unknown fields are ignored and known ones nextstate cannot honour
(images, documents, `top_k`) are a 400 that says so. Extended thinking, in each of its forms, is
accepted and served without thinking blocks (this model has none).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from nextstate.proxy.wire import ExtraAllowedModel, SessionFields, function_tool


class TextPart(ExtraAllowedModel):
    """A text block inside a tool_result or `system` (no tool blocks nest there)."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text blocks are supported here, not '{self.type}'")
        return self


class Block(ExtraAllowedModel):
    """A content block of a request message; only text and the two tool blocks are taken."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextPart] | None = None  # tool_result
    is_error: bool | None = None  # tool_result

    @model_validator(mode="after")
    def _supported(self) -> Block:
        if self.type == "text":
            if self.text is None:
                raise ValueError("a text block needs 'text'")
        elif self.type == "tool_use":
            if not self.id or not self.name or self.input is None:
                raise ValueError("a tool_use block needs 'id', 'name' and 'input'")
        elif self.type == "tool_result":
            if not self.tool_use_id:
                raise ValueError("a tool_result block needs 'tool_use_id'")
        elif self.type in ("thinking", "redacted_thinking"):
            pass  # an earlier reply's reasoning, sent back: not rendered (this model has none)
        else:
            raise ValueError(f"content blocks of type '{self.type}' are not supported; this model takes text and tools only")
        return self

    def result_text(self) -> str:
        """A tool_result's content as the text a tool message carries."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or [])


class InputMessage(ExtraAllowedModel):
    # "system": Claude Code sends one among its messages (the real API refuses it, and Claude
    # Code retries without); served here as a system message where it stands
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _not_empty(self) -> InputMessage:
        if isinstance(self.content, list) and not self.content:
            raise ValueError("content must be a string or a non-empty list of blocks")
        return self


class Tool(ExtraAllowedModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"; server tools (web search, ...) are not served here

    @model_validator(mode="after")
    def _custom_only(self) -> Tool:
        if self.type not in (None, "custom"):
            raise ValueError(f"tools of type '{self.type}' are not supported; only custom tools with an input_schema are")
        return self


class ToolChoice(ExtraAllowedModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(ExtraAllowedModel):
    """`adaptive`, `enabled` (with `budget_tokens`) or `disabled`. The model has no thinking, so
    every form is served as the real API serves a model that thinks little: no thinking blocks,
    the reply straight away. Claude Code sends `adaptive` on every request and gives up after
    six refusals of it."""

    type: Literal["adaptive", "enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesRequest(SessionFields):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=4)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MessagesRequest:
        if self.top_k is not None:
            raise ValueError("top_k is not supported by this server; use temperature or top_p")
        if any(not s for s in self.stop_sequences or []):
            raise ValueError("stop sequences must not be empty")
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if choice.name not in {t.name for t in self.tools or []}:
                raise ValueError(f"tool_choice names '{choice.name}', which is not in tools")
        elif choice is not None and choice.type == "any" and not self.tools:
            raise ValueError("tool_choice 'any' needs tools")
        return self

    # ------------------------------------------------------------------ the turn's shapes

    def to_turn_messages(self) -> list[dict[str, Any]]:
        """OpenAI chat messages, as chat completions' `to_plain` makes them."""
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(block.text or "" for block in self.system)
            out.append({"role": "system", "content": text})
        for message in self.messages:
            blocks = [Block(type="text", text=message.content)] if isinstance(message.content, str) else message.content
            text = "".join(block.text or "" for block in blocks if block.type == "text")
            if message.role == "system":
                out.append({"role": "system", "content": text})
                continue
            if message.role == "assistant":
                reply: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [b for b in blocks if b.type == "tool_use"]
                if calls:
                    reply["tool_calls"] = [
                        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}} for b in calls
                    ]
                out.append(reply)
                continue
            for block in blocks:
                if block.type == "tool_result":
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.result_text()})
            if any(block.type == "text" for block in blocks):
                out.append({"role": "user", "content": text})
        return out

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [function_tool(t.name, t.description, t.input_schema) for t in self.tools]

    def tool_choice_plain(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(1, ge=1)


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as the object a tool_use block's `input` is."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
