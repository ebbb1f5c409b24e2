"""The decode loop's text side: sampled token ids → what the client reads.

One `Decoder` per generation turns each sampled token into a delta of visible text, tool calls
and logprobs: it detokenises incrementally (no broken multi-byte characters), cuts at stop
strings, and lifts `<tool_call>` blocks out of the text. It knows nothing of HTTP or of any
API's wire format, so every API served from the same turns (chat completions, Messages,
Responses) shares it, and streamed and non-streamed replies can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nextstate.core.policy import PolicyRef
from nextstate.engine.base import GeneratedToken
from nextstate.modelio.text_stream import incremental_detokenizer, StopStringMatcher
from nextstate.modelio.tool_calls import ParsedToolCall, ToolCallParser


@dataclass(frozen=True)
class Admitted:
    """The engine has taken the request: a stream can start now, long before the first token.
    `policy` is the version that serves it, looked up right before the engine."""

    policy: PolicyRef


@dataclass(frozen=True)
class StillWorking:
    """Nothing new for a while (a long prefill): a stream should show it is alive."""


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class Delta:
    """What one or more tokens added: text, completed tool calls, and their logprobs."""

    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.logprobs)

    def extend(self, other: Delta) -> None:
        """Append a later delta (tokens that arrived together go out as one chunk)."""
        self.content += other.content
        self.tool_calls += other.tool_calls
        self.logprobs += other.logprobs


@dataclass
class Finished:
    """The whole reply, once generation ended."""

    finish_reason: str
    content: str
    tool_calls: list[ParsedToolCall]
    logprobs: list[TokenLogprob]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens the engine had cached, if it says
    stop_sequence: str | None = None  # the request's stop string that ended the reply

    @property
    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def message(self) -> dict[str, Any]:
        """The assistant message as OpenAI's chat shape has it: what sessions chain on and
        records keep, whichever API served the turn."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None, "refusal": None}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        elif msg["content"] is None:
            msg["content"] = ""
        return msg


# What `TurnService.run` yields, in this order: Admitted, then StillWorking / Delta, then Finished.
TurnEvent = Admitted | StillWorking | Delta | Finished


class Decoder:
    def __init__(
        self,
        tokenizer: Any,
        *,
        stop_token_ids: tuple[int, ...],
        stop_strings: list[str],
        parse_tools: bool,
        parallel_calls: bool = True,
        prefill: str = "",
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self._stop_ids = set(stop_token_ids)
        self._detok = incremental_detokenizer(tokenizer, skip_ids=stop_token_ids)
        self._stops = StopStringMatcher(stop_strings)
        self._parser = ToolCallParser(enabled=parse_tools, parallel=parallel_calls)
        self._token_text = token_text  # None: the client asked for no logprobs
        self._pending_logprobs: list[TokenLogprob] = []
        self._content: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self.finish_reason = "stop"
        if prefill:
            self._parser.push(prefill)

    @property
    def stopped(self) -> bool:
        """A stop string was reached, or the reply's tool calls are complete: generation
        should end now."""
        return self._stops.stopped or self._parser.ended

    def push(self, tok: GeneratedToken) -> Delta:
        if self._token_text is not None and tok.token_id not in self._stop_ids:
            entry = TokenLogprob(
                self._token_text(tok.token_id), tok.logprob, tuple((self._token_text(t), lp) for t, lp in tok.top_logprobs)
            )
            self._pending_logprobs.append(entry)
            self._logprobs.append(entry)
        delta = self._absorb(self._stops.push(self._detok.push(tok.token_id)))
        if self.stopped:
            self.finish_reason = "stop"
        elif tok.finish_reason is not None:
            self.finish_reason = tok.finish_reason
        if delta.content or delta.tool_calls:
            delta.logprobs, self._pending_logprobs = self._pending_logprobs, []
            self._content.append(delta.content)
        return delta

    def flush(self) -> Delta:
        """Everything still held back once generation ended."""
        tail = Delta(logprobs=self._pending_logprobs)
        self._pending_logprobs = []
        if not self._stops.stopped:
            tail = self._absorb(self._stops.push(self._detok.flush()) + self._stops.flush(), tail)
        flushed = self._parser.flush()
        tail.content += flushed.content
        tail.tool_calls += flushed.tool_calls
        self._content.append(tail.content)
        if self._parser.calls:
            # Valid calls end the reply whatever came after them (a cut-off or broken extra
            # block is not part of it), so the agent runs them.
            self.finish_reason = "tool_calls"
        return tail

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Finished:
        return Finished(
            finish_reason=self.finish_reason,
            content="".join(self._content),
            tool_calls=list(self._parser.calls),
            logprobs=self._logprobs,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            stop_sequence=self._stops.matched,
        )

    def _absorb(self, text: str, out: Delta | None = None) -> Delta:
        out = out or Delta()
        parsed = self._parser.push(text)
        out.content += parsed.content
        out.tool_calls += parsed.tool_calls
        return out
