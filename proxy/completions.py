"""Chat completions: render → engine → text, tool calls and logprobs → OpenAI responses.

One generation loop (`_run`) feeds both the JSON response and the SSE stream, so streamed and
non-streamed replies can never disagree. When a main turn finishes, its exact prompt ids,
sampled ids and sampling logprobs are committed to its session, where the next request of
that session turns them into a transition for the judge.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.base import Engine, EngineError, GeneratedToken, SamplingParams
from nextstate.activity import Activity
from nextstate.policy import PolicyDirectory, PolicyRef
from nextstate.types import Turn
from proxy.chat_template import ChatRenderer, RenderedPrompt, normalize_message
from proxy.errors import OpenAIError, invalid_request
from proxy.keys import ApiKey
from proxy.metrics import Metrics
from proxy.records import RecordWriter
from proxy.schemas import ChatCompletionRequest
from proxy.sessions import SessionStore, TurnPlan
from proxy.text_stream import IncrementalDetokenizer, StopStringMatcher
from proxy.tool_calls import ParsedToolCall, ToolCallParser

_TRUE = {"1", "true", "yes", "on"}


def engine_error(exc: EngineError) -> OpenAIError:
    """The engine's failure as the client should see it: 502/503/504 for an engine that is
    down, slow or broken (retry later), 400 for a request it refused."""
    status = exc.http_status
    if status >= 500:
        return OpenAIError(status, f"The model server failed: {exc}", type="server_error", code="engine_error")
    return OpenAIError(status, f"The model server refused the request: {exc}", code="engine_rejected")


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


@dataclass(frozen=True)
class TurnHints:
    """What the client said about the session, via headers or body fields."""

    session_id: str | None = None
    turn_type: str | None = None
    done: bool = False
    outcome_expected: bool = False

    @classmethod
    def from_request(cls, headers: Any, body: ChatCompletionRequest) -> TurnHints:
        turn_type = headers.get("x-turn-type") or body.turn_type
        if turn_type is not None:
            turn_type = turn_type.strip().lower()
            if turn_type not in ("main", "side"):
                raise invalid_request("X-Turn-Type must be 'main' or 'side'.", param="X-Turn-Type")
        session_id = headers.get("x-session-id") or body.session_id
        if session_id is not None and not 0 < len(session_id.strip()) <= 200:
            raise invalid_request("X-Session-Id must be 1-200 characters.", param="X-Session-Id")
        done_header = headers.get("x-session-done")
        done = done_header.strip().lower() in _TRUE if done_header is not None else bool(body.session_done)
        outcome_header = headers.get("x-outcome-expected")
        outcome = outcome_header.strip().lower() in _TRUE if outcome_header is not None else bool(body.outcome_expected)
        return cls(session_id.strip() if session_id else None, turn_type, done, outcome)


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    key: ApiKey
    messages: list[dict[str, Any]]
    prompt: RenderedPrompt
    sampling: SamplingParams
    plan: TurnPlan
    policy: PolicyRef
    hints: TurnHints
    completion_id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)

    @property
    def headers(self) -> dict[str, str]:
        out = {"X-Turn-Type": self.plan.turn_type, "X-Policy-Version": str(self.policy.version)}
        if self.plan.session_id:
            out["X-Session-Id"] = self.plan.session_id
        return out


@dataclass
class Delta:
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Finished:
    finish_reason: str
    content: str
    tool_calls: list[ParsedToolCall]
    logprobs: list[dict[str, Any]]
    prompt_tokens: int
    completion_tokens: int

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None, "refusal": None}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


class ChatService:
    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        sessions: SessionStore,
        records: RecordWriter,
        policies: PolicyDirectory,
        metrics: Metrics,
        model_name: str,
        default_max_tokens: int,
        activity: Activity | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sessions = sessions
        self.records = records
        self.policies = policies
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.activity = activity or Activity()

    # ------------------------------------------------------------------ preparation

    async def prepare(self, body: ChatCompletionRequest, key: ApiKey, hints: TurnHints) -> PreparedChat:
        if body.model != self.model_name:
            raise OpenAIError(
                404,
                f"The model '{body.model}' does not exist here; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )
        messages = [normalize_message(m) for m in body.messages]
        prompt = await asyncio.to_thread(self.renderer.render, messages, body.tools, body.tool_choice)
        sampling = self._sampling(body, len(prompt.ids))
        plan = self.sessions.resolve(
            key.user, messages, session_id=hints.session_id, turn_type=hints.turn_type, done=hints.done
        )
        self.metrics.turns.labels(plan.turn_type, plan.match).inc()
        self.metrics.sessions_open.set(len(self.sessions))
        return PreparedChat(body, key, messages, prompt, sampling, plan, self.policies.current(key.user), hints)

    def _sampling(self, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        limit = self.engine.info.max_context
        room = limit - prompt_len
        requested = body.requested_max_tokens
        if room < 1 or (requested is not None and requested > room):
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + (requested or 1)} tokens ({prompt_len} in the messages, "
                f"{requested or 1} in the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=requested or min(self.default_max_tokens, room),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop_token_ids=self.renderer.stop_token_ids,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        )

    # ------------------------------------------------------------------ generation

    async def _run(self, prep: PreparedChat) -> AsyncIterator[Delta | Finished]:
        body = prep.request
        tokenizer = self.renderer.tokenizer
        stop_ids = set(prep.sampling.stop_token_ids)
        detok = IncrementalDetokenizer(tokenizer, skip_ids=tuple(stop_ids))
        stops = StopStringMatcher(body.stop_strings)
        parser = ToolCallParser(enabled=bool(body.tools) and body.tool_choice != "none")
        want_logprobs = bool(body.logprobs)
        response_ids: list[int] = []
        sampled_logprobs: list[float] = []
        content: list[str] = []
        all_logprobs: list[dict[str, Any]] = []
        pending_lp: list[dict[str, Any]] = []
        finish = "stop"

        def absorb(text: str, out: Delta) -> None:
            parsed = parser.push(text)
            out.content += parsed.content
            out.tool_calls += parsed.tool_calls

        if prep.prompt.prefill:
            parser.push(prep.prompt.prefill)
        self.metrics.in_flight.inc()
        stream = self.engine.generate(prep.prompt.ids, prep.sampling, prep.policy.adapter)
        with self.activity.request():
            try:
                async for tok in stream:
                    if not response_ids:
                        self.metrics.ttft.observe(time.monotonic() - prep.started)
                    response_ids.append(tok.token_id)
                    sampled_logprobs.append(tok.logprob)
                    if want_logprobs and tok.token_id not in stop_ids:
                        entry = self._logprob_entry(tok)
                        pending_lp.append(entry)
                        all_logprobs.append(entry)
                    delta = Delta()
                    absorb(stops.push(detok.push(tok.token_id)), delta)
                    if stops.stopped:
                        finish = "stop"
                    elif tok.finish_reason is not None:
                        finish = tok.finish_reason
                    if delta.content or delta.tool_calls:
                        delta.logprobs, pending_lp = pending_lp, []
                        content.append(delta.content)
                        yield delta
                    if stops.stopped:
                        break
            except EngineError as exc:
                raise engine_error(exc) from exc
            finally:
                await stream.aclose()
                self.metrics.in_flight.dec()

        tail = Delta(logprobs=pending_lp)
        if not stops.stopped:
            absorb(stops.push(detok.flush()) + stops.flush(), tail)
        flushed = parser.flush()
        tail.content += flushed.content
        tail.tool_calls += flushed.tool_calls
        content.append(tail.content)
        if tail.content or tail.tool_calls or tail.logprobs:
            yield tail
        if parser.calls and finish == "stop":
            finish = "tool_calls"
        done = Finished(
            finish_reason=finish,
            content="".join(content),
            tool_calls=list(parser.calls),
            logprobs=all_logprobs,
            prompt_tokens=len(prep.prompt.ids),
            completion_tokens=len(response_ids),
        )
        self._commit(prep, done, response_ids, sampled_logprobs)
        yield done

    def _logprob_entry(self, tok: GeneratedToken) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.renderer.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        entry = one(tok.token_id, tok.logprob)
        entry["top_logprobs"] = [one(t, lp) for t, lp in tok.top_logprobs]
        return entry

    def _commit(self, prep: PreparedChat, done: Finished, response_ids: list[int], logprobs: list[float]) -> None:
        """Record the request and, for a main turn, hand its tokens to the session."""
        plan, message = prep.plan, done.message()
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        self.metrics.completion_tokens.inc(done.completion_tokens)
        self.metrics.latency.observe(time.monotonic() - prep.started)
        record: dict[str, Any] = {
            "id": prep.completion_id,
            "user": prep.key.user,
            "session_id": plan.session_id,
            "turn_type": plan.turn_type,
            "session_match": plan.match,
            "turn_index": plan.turn_index,
            "policy_version": prep.policy.version,
            "adapter": prep.policy.adapter,
            "messages": prep.messages,
            "tools": [t.model_dump(exclude_none=True) for t in prep.request.tools or []] or None,
            "response": message,
            "finish_reason": done.finish_reason,
            "usage": done.usage,
            "latency_s": round(time.monotonic() - prep.started, 4),
        }
        if plan.turn_type == "main" and plan.session is not None:
            turn = Turn(
                session_id=plan.session.id,
                user=prep.key.user,
                turn_index=plan.turn_index or 0,
                messages=prep.messages,
                tools=record["tools"],
                tool_choice=_dump(prep.request.tool_choice),
                prompt_ids=prep.prompt.ids,
                response_ids=response_ids,
                response_logprobs=logprobs,
                logprob_temperature=prep.sampling.logprob_temperature,
                sampling={
                    "temperature": prep.sampling.temperature,
                    "top_p": prep.sampling.top_p,
                    "max_new_tokens": prep.sampling.max_new_tokens,
                    "seed": prep.sampling.seed,
                },
                policy_version=prep.policy.version,
                adapter=prep.policy.adapter,
                response_message=message,
                finish_reason=done.finish_reason,
                created_at=time.time(),
                track="outcome" if prep.hints.outcome_expected else "personal",
            )
            record.update(prompt_ids=prep.prompt.ids, response_ids=response_ids, response_logprobs=logprobs)
            self.records.write("request", record, version=prep.policy.version)
            self.sessions.commit_main(plan, turn, message)
        else:
            self.records.write("request", record, version=prep.policy.version)
            self.sessions.finish_side(plan)
        self.metrics.sessions_open.set(len(self.sessions))

    # ------------------------------------------------------------------ OpenAI shapes

    async def complete(self, prep: PreparedChat) -> dict[str, Any]:
        done: Finished | None = None
        async for event in self._run(prep):
            if isinstance(event, Finished):
                done = event
        assert done is not None
        return {
            "id": prep.completion_id,
            "object": "chat.completion",
            "created": prep.created,
            "model": self.model_name,
            "system_fingerprint": f"nextstate-v{prep.policy.version}",
            "choices": [
                {
                    "index": 0,
                    "message": done.message(),
                    "logprobs": {"content": done.logprobs, "refusal": None} if prep.request.logprobs else None,
                    "finish_reason": done.finish_reason,
                }
            ],
            "usage": done.usage,
        }

    async def stream(self, prep: PreparedChat) -> AsyncIterator[str]:
        include_usage = bool(prep.request.stream_options and prep.request.stream_options.include_usage)
        want_logprobs = bool(prep.request.logprobs)

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None) -> str:
            body: dict[str, Any] = {
                "id": prep.completion_id,
                "object": "chat.completion.chunk",
                "created": prep.created,
                "model": self.model_name,
                "system_fingerprint": f"nextstate-v{prep.policy.version}",
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": logprobs or [], "refusal": None} if want_logprobs else None,
                        "finish_reason": finish,
                    }
                ],
            }
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        events = self._run(prep)
        # The first event is awaited before anything is sent, so an engine that is down or
        # refuses the request still gets its proper status code (502/503/504/400).
        first = await anext(events)
        yield chunk({"role": "assistant", "content": ""})

        async def rest():
            yield first
            async for event in events:
                yield event

        try:
            async for event in rest():
                if isinstance(event, Delta):
                    if event.content or (event.logprobs and not event.tool_calls):
                        yield chunk({"content": event.content}, logprobs=event.logprobs)
                    for call in event.tool_calls:
                        yield chunk(
                            {
                                "tool_calls": [
                                    {
                                        "index": call.index,
                                        "id": call.id,
                                        "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments},
                                    }
                                ]
                            }
                        )
                else:
                    yield chunk({}, finish=event.finish_reason)
                    if include_usage:
                        usage_chunk = {
                            "id": prep.completion_id,
                            "object": "chat.completion.chunk",
                            "created": prep.created,
                            "model": self.model_name,
                            "system_fingerprint": f"nextstate-v{prep.policy.version}",
                            "choices": [],
                            "usage": event.usage,
                        }
                        yield f"data: {json.dumps(usage_chunk)}\n\n"
        except OpenAIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
            return
        yield "data: [DONE]\n\n"
