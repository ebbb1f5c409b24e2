"""Anthropic Messages on top of the API-neutral turn path.

`MessagesServing` converts a Messages request into the same `TurnRequest` chat completions
makes, and the turn's events back into Anthropic's message object or its event stream:
`message_start`, then per content block `content_block_start` / `content_block_delta`
(`text_delta`, or one `input_json_delta` with a tool call's whole input: calls are only
released once complete) / `content_block_stop`, then `message_delta` (stop reason, usage) and
`message_stop`; `ping` while a long prompt is prefilled.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from nextstate.core.policy import PolicyRef
from nextstate.proxy.decode import Finished
from nextstate.proxy.decode import Delta as TurnDelta
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.messages.protocol import MessagesRequest, tool_input
from nextstate.proxy.sse import sse_event
from nextstate.proxy.turn_stream import stream_turn
from nextstate.proxy.turns import PreparedTurn, TurnRequest, TurnService
from nextstate.proxy.wire import TurnHints
from nextstate.modelio.tool_calls import ParsedToolCall

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def turn_request(body: MessagesRequest, headers: Mapping[str, str]) -> TurnRequest:
    return TurnRequest(
        model=body.model,
        messages=body.to_turn_messages(),
        hints=TurnHints.from_request(headers, body),
        tools=body.tool_dicts(),
        tool_choice=body.tool_choice_plain(),
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=list(body.stop_sequences or []),
        parallel_tool_calls=body.parallel_tool_calls,
        id_prefix="msg_",
    )


def stop_reason(done: Finished) -> str:
    return "stop_sequence" if done.stop_sequence is not None else _STOP_REASONS.get(done.finish_reason, "end_turn")


def usage(done: Finished) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens *not* read from the cache (its
    clients, OpenClaw's among them, add `cache_read_input_tokens` to them for the prompt's size)."""
    cached = done.cached_tokens or 0
    out: dict[str, Any] = {"input_tokens": done.prompt_tokens - cached, "output_tokens": done.completion_tokens}
    if done.cached_tokens is not None:
        out["cache_read_input_tokens"] = cached
    return out


def tool_use_block(call: ParsedToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}


def event(kind: str, data: dict[str, Any]) -> str:
    return sse_event({"type": kind, **data}, name=kind)


class MessageBuilder:
    """Anthropic's message object and stream events for one reply."""

    def __init__(self, prep: PreparedTurn, model: str) -> None:
        self.id = prep.id
        self.model = model
        self.prompt_tokens = len(prep.prompt.ids)
        self._open: str | None = None  # the block being streamed: "text", or None
        self._index = -1

    def message(self, done: Finished) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": done.content}] if done.content else []
        content += [tool_use_block(call) for call in done.tool_calls]
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason(done), "stop_sequence": done.stop_sequence, "usage": usage(done),
        }

    def start(self, policy: PolicyRef) -> str:
        message = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return event("message_start", {"message": message})

    def delta(self, turn_delta: TurnDelta) -> list[str]:
        out = []
        if turn_delta.content:
            if self._open != "text":
                out += self._close()
                self._index += 1
                self._open = "text"
                out.append(event("content_block_start", {"index": self._index, "content_block": {"type": "text", "text": ""}}))
            out.append(event("content_block_delta", {"index": self._index, "delta": {"type": "text_delta", "text": turn_delta.content}}))
        for call in turn_delta.tool_calls:
            out += self._close()
            self._index += 1
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            out.append(event("content_block_start", {"index": self._index, "content_block": block}))
            arguments = json.dumps(tool_input(call.arguments), ensure_ascii=False)
            out.append(event("content_block_delta", {"index": self._index, "delta": {"type": "input_json_delta", "partial_json": arguments}}))
            out.append(event("content_block_stop", {"index": self._index}))
        return out

    def finish(self, done: Finished) -> list[str]:
        return [
            *self._close(),
            # usage on message_delta is cumulative (Anthropic's SDK overwrites its snapshot with
            # it): the cached prompt tokens, unknown when message_start went out at admission,
            # reach streamed clients here
            event("message_delta", {"delta": {"stop_reason": stop_reason(done), "stop_sequence": done.stop_sequence},
                                    "usage": usage(done)}),
            event("message_stop", {}),
        ]

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", {"index": self._index})]

    # with start, delta and finish above: the StreamWriter of proxy/turn_stream.py
    def keep_alive(self) -> str:
        return event("ping", {})

    def error(self, exc: ApiError) -> str:
        return event("error", {"error": exc.anthropic_body()["error"]})

    def end(self) -> list[str]:
        return []


class MessagesServing:
    def __init__(self, turns: TurnService) -> None:
        self.turns = turns

    @property
    def model_name(self) -> str:
        return self.turns.model_name

    async def prepare(self, body: MessagesRequest, headers: Mapping[str, str], key: ApiKey) -> PreparedTurn:
        return await self.turns.prepare(turn_request(body, headers), key)

    async def count_tokens(self, body: MessagesRequest, headers: Mapping[str, str], user: str) -> dict[str, int]:
        """The prompt's length as the model would read it: rendered exactly as a reply would be."""
        prompt = await self.turns.render(turn_request(body, headers), user)
        return {"input_tokens": len(prompt.ids)}

    async def complete(self, prep: PreparedTurn) -> dict[str, Any]:
        done = await self.turns.complete(prep)
        return MessageBuilder(prep, self.model_name).message(done)

    def stream(self, prep: PreparedTurn) -> AsyncIterator[str]:
        """SSE events: message_start once the engine admitted the request, `ping` during a long
        prefill, an `error` event after the start (proxy/turn_stream.stream_turn)."""
        return stream_turn(self.turns.run(prep), MessageBuilder(prep, self.model_name))
