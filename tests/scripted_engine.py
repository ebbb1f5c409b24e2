"""A test engine that 'generates' known text through the real tokenizer.

The tiny model's output is gibberish, so tests that need specific replies (tool calls, stop
strings, timing of streamed chunks) script the text instead. Everything after the engine —
detokenisation, stop strings, tool-call parsing, sessions, records — is the production path.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from nextstate.engine.base import EngineInfo, GeneratedToken, SamplingParams


class ScriptedEngine:
    def __init__(
        self, tokenizer, replies: list[str] | None = None, delay_s: float = 0.0, max_context: int = 4096,
        default_reply: str = "ok", respond=None,
    ):
        self.tokenizer = tokenizer
        self.replies: deque[str | list[int]] = deque(replies or [])
        self.default_reply = default_reply
        # (prompt text, sampling) -> the reply, for requests whose order is not known in advance
        self.respond = respond
        self._default_ids = None
        self.delay_s = delay_s
        self.prefill_s = 0.0  # a pause before the first token, as a long prompt's prefill
        self.fail_after_admit: Exception | None = None  # raised once the request was admitted
        self.generated = 0  # tokens yielded so far, over all generations
        self.info = EngineInfo(model_name="scripted", max_context=max_context, device="cpu", dtype="float32")
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._adapters: set[str] = set()

    def script(self, *replies: str | list[int]) -> None:
        """Replies to give, in order: a text (encoded as the tokenizer does) or the ids a model
        sampled (which need not be the tokenizer's own encoding of their text)."""
        self.replies.extend(replies)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, adapter: str | None = None, background: bool = False,
        on_admit=None,
    ) -> AsyncIterator[GeneratedToken]:
        if on_admit is not None:
            on_admit()
        if self.prefill_s:
            await asyncio.sleep(self.prefill_s)
        if self.fail_after_admit is not None:
            raise self.fail_after_admit
        self.prompts.append(list(input_ids))
        self.samplings.append(sampling)
        if self.respond is not None:
            ids = self._encode(self.respond(self.tokenizer.decode(input_ids), sampling))
        elif self.replies:
            ids = self._encode(self.replies.popleft())
        else:  # tokenised once: a bench sends thousands of requests
            self._default_ids = self._default_ids or self._encode(self.default_reply)
            ids = self._default_ids
        for i, token in enumerate(ids[: sampling.max_new_tokens]):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = i == len(ids) - 1 or i == sampling.max_new_tokens - 1
            reason = None if not last else ("stop" if token == self.eos else "length")
            self.generated += 1
            yield GeneratedToken(token, -0.5, ((token, -0.5),) * sampling.top_logprobs, reason)

    def _encode(self, reply: str | list[int]) -> list[int]:
        ids = reply if isinstance(reply, list) else self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        return list(ids) + [self.eos]

    async def score(self, input_ids, start, adapter=None, temperature=1.0, background=False):
        return [-0.5] * (len(input_ids) - start)

    async def load_adapter(self, name, path):
        self._adapters.add(name)

    async def unload_adapter(self, name):
        self._adapters.discard(name)

    @property
    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def close(self):
        pass
