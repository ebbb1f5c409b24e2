"""Chat completions on top of the API-neutral turn path.

`ChatCompletionServing` converts an OpenAI request into a `TurnRequest`, and the turn's events
back into OpenAI's JSON response or its server-sent-event stream. Every envelope (id, model,
created, fingerprint) comes from one `ChatCompletionBuilder`, so a response and its chunks can
never disagree on them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import pydantic_core

from nextstate.core.policy import PolicyRef
from nextstate.proxy.chat_completion.protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCallOut,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from nextstate.proxy.decode import Finished
from nextstate.proxy.decode import Delta as TurnDelta
from nextstate.proxy.decode import TokenLogprob as TurnLogprob
from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.proxy.sse import sse_comment, sse_event, sse_done
from nextstate.proxy.turn_stream import stream_turn
from nextstate.proxy.turns import PreparedTurn, TurnRequest, TurnService
from nextstate.proxy.wire import TurnHints


def turn_request(body: ChatCompletionRequest, headers: Mapping[str, str]) -> TurnRequest:
    return TurnRequest(
        model=body.model,
        messages=[m.to_plain() for m in body.messages],
        hints=TurnHints.from_request(headers, body),
        tools=body.tool_dicts(),
        tool_choice=body.tool_choice_plain(),
        max_tokens=body.requested_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings,
        top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        reply_schema=body.response_format.schema_text() if body.response_format else None,
    )


def _logprobs(entries: list[TurnLogprob]) -> list[TokenLogprob]:
    def one(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    return [
        TokenLogprob(**one(e.token, e.logprob).model_dump(), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries
    ]


_PROBE = "\x01nextstate text\x02"
_PROBE_JSON = pydantic_core.to_json(_PROBE).decode()


class ChatCompletionBuilder:
    """OpenAI's response and chunk objects for one completion."""

    def __init__(self, prep: PreparedTurn, model: str, include_usage: bool, want_logprobs: bool) -> None:
        self.prep, self.model = prep, model
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs

    def _open(self, policy: PolicyRef) -> None:
        """The envelope, and the text chunks' template, once the version that serves the reply
        (the fingerprint) is settled: when the engine admitted it."""
        self.envelope = {
            "id": self.prep.id,
            "created": self.prep.created,
            "model": self.model,
            "system_fingerprint": f"nextstate-v{policy.version}",
        }
        # Most chunks of a stream carry nothing but text: their JSON is this builder's own
        # chunk for a probe text, with the text put in its place (0.7 µs a chunk against 12 for
        # building and dumping the model; tests/test_chat_chunks.py holds them equal).
        probe = self._chunk_json(Delta(content=_PROBE))
        head, *tail = probe.split(_PROBE_JSON)
        self._text_chunk = (head, tail[0]) if len(tail) == 1 and not self.want_logprobs else None

    def response(self, done: Finished) -> ChatCompletionResponse:
        assert self.prep.policy is not None, "a finished turn was admitted"
        self._open(self.prep.policy)
        message = AssistantMessage(
            content=done.message()["content"],
            tool_calls=[_tool_call(c) for c in done.tool_calls] or None,
        )
        logprobs = ChoiceLogprobs(content=_logprobs(done.logprobs)) if self.want_logprobs else None
        choice = Choice(message=message, logprobs=logprobs, finish_reason=done.finish_reason)
        return ChatCompletionResponse(**self.envelope, choices=[choice], usage=Usage(**done.usage))

    def chunk(self, delta: Delta, finish_reason: str | None = None, logprobs: list[TurnLogprob] | None = None) -> str:
        return sse_event(self._chunk_json(delta, finish_reason, logprobs))

    def _chunk_json(
        self, delta: Delta, finish_reason: str | None = None, logprobs: list[TurnLogprob] | None = None
    ) -> str:
        lp = ChoiceLogprobs(content=_logprobs(logprobs or [])) if self.want_logprobs else None
        body = ChatCompletionChunk(
            **self.envelope, choices=[ChunkChoice(delta=delta, logprobs=lp, finish_reason=finish_reason)]
        )
        return body.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def text_chunk(self, text: str) -> str:
        """`chunk(Delta(content=text))`, from the template."""
        if self._text_chunk is None:
            return self.chunk(Delta(content=text))
        head, tail = self._text_chunk
        return sse_event(head + pydantic_core.to_json(text).decode() + tail)

    def usage_chunk(self, done: Finished) -> str:
        body = ChatCompletionChunk(**self.envelope, choices=[], usage=Usage(**done.usage))
        return sse_event(body.model_dump_json())

    # the StreamWriter of proxy/turn_stream.py: start, keep_alive, delta, finish, error, end
    def start(self, policy: PolicyRef) -> str:
        self._open(policy)
        return self.chunk(Delta(role="assistant", content=""))

    def keep_alive(self) -> str:
        return sse_comment()

    def delta(self, event: TurnDelta) -> list[str]:
        out = []
        if event.content and not self.want_logprobs:
            out.append(self.text_chunk(event.content))
        elif event.content or (event.logprobs and not event.tool_calls):
            out.append(self.chunk(Delta(content=event.content), logprobs=event.logprobs))
        for call in event.tool_calls:
            out.append(self.chunk(Delta(tool_calls=[ToolCallDelta(index=call.index, **_tool_call(call).model_dump())])))
        return out

    def finish(self, done: Finished) -> list[str]:
        return [self.chunk(Delta(), finish_reason=done.finish_reason), *([self.usage_chunk(done)] if self.include_usage else [])]

    def error(self, exc: ApiError) -> str:
        return sse_event(exc.body())

    def end(self) -> list[str]:
        return [sse_done()]


def _tool_call(call) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


class ChatCompletionServing:
    def __init__(self, turns: TurnService) -> None:
        self.turns = turns

    @property
    def model_name(self) -> str:
        return self.turns.model_name

    async def prepare(self, body: ChatCompletionRequest, headers: Mapping[str, str], key: ApiKey) -> PreparedTurn:
        return await self.turns.prepare(turn_request(body, headers), key)

    def _builder(self, prep: PreparedTurn, body: ChatCompletionRequest) -> ChatCompletionBuilder:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ChatCompletionBuilder(prep, self.model_name, include_usage, bool(body.logprobs))

    async def complete(self, prep: PreparedTurn, body: ChatCompletionRequest) -> dict:
        done = await self.turns.complete(prep)
        return self._builder(prep, body).response(done).model_dump()

    def stream(self, prep: PreparedTurn, body: ChatCompletionRequest) -> AsyncIterator[str]:
        """SSE lines: the role chunk once the engine admitted the request, keep-alive comments
        during a long prefill, then content / tool-call chunks, the finish, usage if asked and
        `[DONE]` (proxy/turn_stream.stream_turn)."""
        return stream_turn(self.turns.run(prep), self._builder(prep, body))
