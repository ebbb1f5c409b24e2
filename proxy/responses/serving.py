"""OpenAI Responses on top of the API-neutral turn path.

`ResponsesServing` builds the turn's conversation — instructions, the stored conversation of
`previous_response_id` (the user's own only), then the new input — as the same `TurnRequest`
chat completions makes, and turns the reply into a Response object (a `message` output item
with `output_text`, then one `function_call` item per call) or its event stream:
`response.created`, `response.in_progress`, per item `response.output_item.added` …
`response.output_item.done` (with `response.output_text.delta`s, or a call's
`response.function_call_arguments.delta`/`.done`: calls are only released once complete),
then `response.completed` (`response.incomplete` at `max_output_tokens`). With `store` (the
default) the conversation is kept for a later `previous_response_id`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from nextstate.modelio.chat_template import parse_arguments
from nextstate.modelio.tool_calls import ParsedToolCall
from nextstate.core.policy import PolicyRef
from nextstate.proxy.decode import Finished
from nextstate.proxy.decode import Delta as TurnDelta
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.responses.protocol import ResponsesRequest
from nextstate.core.stores.responses import ResponseStore
from nextstate.proxy.sse import sse_comment, sse_event
from nextstate.proxy.turn_stream import stream_turn
from nextstate.proxy.turns import PreparedTurn, TurnRequest, TurnService
from nextstate.proxy.wire import TurnHints


def stored_reply(done: Finished) -> dict[str, Any]:
    """The reply as a message of a stored conversation (chat shape, arguments as objects)."""
    reply: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.tool_calls:
        reply["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": parse_arguments(c.arguments)}}
            for c in done.tool_calls
        ]
    return reply


def usage(done: Finished) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens or 0},
        "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


class ResponseBuilder:
    """The Response object and its stream events for one reply."""

    def __init__(self, prep: PreparedTurn, model: str, body: ResponsesRequest) -> None:
        self.key = prep.id.removeprefix("resp_")
        self.id = prep.id
        self.message_id = "msg_" + self.key
        self.model = model
        self.created_at = prep.created
        self.body = body
        self._sequence = 0
        self._index = -1  # output index of the item being streamed
        self._text: str | None = None  # the open message item's text so far

    def response(self, status: str, output: list[dict[str, Any]], done: Finished | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": incomplete, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "text": {"format": body.text_format()},
            "truncation": "disabled", "store": body.store is not False, "metadata": body.metadata or {},
            "usage": usage(done) if done is not None else None,
        }

    def final(self, done: Finished) -> dict[str, Any]:
        output = [self._message_item(done.content, "completed")] if done.content else []
        output += [self._call_item(call, "completed") for call in done.tool_calls]
        return self.response("incomplete" if done.finish_reason == "length" else "completed", output, done)

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def _call_item(self, call: ParsedToolCall, status: str) -> dict[str, Any]:
        return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
                "call_id": call.id, **self.body.call_names(call.name),
                "arguments": call.arguments if status == "completed" else ""}

    # ------------------------------------------------------------------ events

    def event(self, kind: str, **data: Any) -> str:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence, **data}
        return sse_event(payload, name=kind)

    # the StreamWriter of proxy/turn_stream.py
    def start(self, policy: PolicyRef) -> str:
        response = self.response("in_progress", [])
        return self.event("response.created", response=response) + self.event("response.in_progress", response=response)

    def keep_alive(self) -> str:
        return sse_comment()

    def error(self, exc: ApiError) -> str:
        return self.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)

    def end(self) -> list[str]:
        return []

    def delta(self, turn_delta: TurnDelta) -> list[str]:
        out = []
        if turn_delta.content:
            if self._text is None:
                self._index += 1
                self._text = ""
                out.append(self.event("response.output_item.added", output_index=self._index,
                                      item=self._message_item("", "in_progress")))
                out.append(self.event("response.content_part.added", item_id=self.message_id, output_index=self._index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            self._text += turn_delta.content
            out.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=self._index,
                                  content_index=0, delta=turn_delta.content, logprobs=[]))
        for call in turn_delta.tool_calls:
            out += self._close_text()
            self._index += 1
            item = self._call_item(call, "completed")
            out.append(self.event("response.output_item.added", output_index=self._index, item=self._call_item(call, "in_progress")))
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=self._index,
                                  delta=call.arguments))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self._index,
                                  arguments=call.arguments))
            out.append(self.event("response.output_item.done", output_index=self._index, item=item))
        return out

    def finish(self, done: Finished) -> list[str]:
        response = self.final(done)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*self._close_text(), self.event(kind, response=response)]

    def _close_text(self) -> list[str]:
        if self._text is None:
            return []
        text, self._text = self._text, None
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            self.event("response.output_text.done", item_id=self.message_id, output_index=self._index, content_index=0,
                       text=text, logprobs=[]),
            self.event("response.content_part.done", item_id=self.message_id, output_index=self._index, content_index=0,
                       part=part),
            self.event("response.output_item.done", output_index=self._index, item=self._message_item(text, "completed")),
        ]


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


class ResponsesServing:
    def __init__(self, turns: TurnService, store: ResponseStore) -> None:
        self.turns = turns
        self.store = store

    @property
    def model_name(self) -> str:
        return self.turns.model_name

    async def prepare(self, body: ResponsesRequest, headers: Mapping[str, str], key: ApiKey) -> tuple[PreparedTurn, list]:
        """The prepared turn, and its conversation without instructions (what is stored)."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            found = await asyncio.to_thread(self.store.conversation, key.user, body.previous_response_id)
            if found is None:  # another user's id is as unknown as one that never existed
                raise _not_found(body.previous_response_id, param="previous_response_id")
            history = found
        conversation = history + body.new_messages()
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        request = TurnRequest(
            model=body.model, messages=system + conversation, hints=TurnHints.from_request(headers, body),
            tools=body.tool_dicts(), tool_choice=body.tool_choice_plain(), max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, parallel_tool_calls=body.parallel_tool_calls is not False,
            id_prefix="resp_", reply_schema=body.reply_schema(), unlimited=True,
        )
        return await self.turns.prepare(request, key), conversation

    async def _keep(self, prep: PreparedTurn, body: ResponsesRequest, conversation: list, done: Finished, build: ResponseBuilder) -> None:
        if body.store is not False:
            await asyncio.to_thread(self.store.save, prep.key.user, build.id, [*conversation, stored_reply(done)],
                                    build.final(done),
                                    [{"id": f"item_{build.key}_{i}", **item} for i, item in enumerate(body.input_items())])

    async def retrieve(self, user: str, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}`: the Response as it was returned; 404 for an id that is not
        this user's (another user's is as unknown as one that never existed)."""
        return (await self._stored(user, response_id))[0]

    async def input_items(self, user: str, response_id: str) -> dict[str, Any]:
        """`GET /v1/responses/{id}/input_items`: the items this request sent, as OpenAI lists them."""
        _, items = await self._stored(user, response_id)
        return {"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
                "last_id": items[-1].get("id") if items else None, "has_more": False}

    async def delete(self, user: str, response_id: str) -> dict[str, Any]:
        if not await asyncio.to_thread(self.store.delete, user, response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _stored(self, user: str, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        found = await asyncio.to_thread(self.store.response, user, response_id)
        if found is None:
            raise _not_found(response_id)
        return found

    async def complete(self, prep: PreparedTurn, body: ResponsesRequest, conversation: list) -> dict[str, Any]:
        build = ResponseBuilder(prep, self.model_name, body)
        done = await self.turns.complete(prep)
        await self._keep(prep, body, conversation, done, build)
        return build.final(done)

    def stream(self, prep: PreparedTurn, body: ResponsesRequest, conversation: list) -> AsyncIterator[str]:
        """SSE events: response.created and .in_progress once the engine admitted the request,
        an `error` event after that (proxy/turn_stream.stream_turn); the conversation is
        stored before response.completed goes out, so a client may chain on it at once."""
        build = ResponseBuilder(prep, self.model_name, body)

        async def keep(done: Finished) -> None:
            await self._keep(prep, body, conversation, done, build)

        return stream_turn(self.turns.run(prep), build, on_finish=keep)
