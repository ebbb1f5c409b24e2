"""Judge endpoints: any OpenAI-compatible server, or the served base model in-process."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from nextstate.engine.base import Engine, SamplingParams
from nextstate.modelio.chat_template import ChatRenderer


class JudgeClient(Protocol):
    async def complete(self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int) -> str: ...

    async def aclose(self) -> None: ...


class OpenAIJudgeClient:
    """Any OpenAI-compatible chat endpoint (a hosted model, vLLM, SGLang, another nextstate)."""

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        from openai import AsyncOpenAI

        self.model = model
        self._client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=1)

    async def complete(self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int) -> str:
        reply = await self._client.chat.completions.create(
            model=self.model, messages=messages, temperature=temperature, max_tokens=max_tokens
        )
        return reply.choices[0].message.content or "" if reply.choices else ""

    async def aclose(self) -> None:
        await self._client.close()


class EngineJudgeClient:
    """The serving engine's base model (no adapter) as its own judge: zero extra setup."""

    def __init__(self, engine: Engine, renderer: ChatRenderer) -> None:
        self.engine = engine
        self.renderer = renderer

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int) -> str:
        prompt = await asyncio.to_thread(self.renderer.render, messages)
        room = self.engine.info.max_context - len(prompt.ids)
        if room < 1:
            raise ValueError(f"judge prompt of {len(prompt.ids)} tokens does not fit the context")
        params = SamplingParams(
            max_new_tokens=min(max_tokens, room), temperature=temperature, stop_token_ids=self.renderer.stop_token_ids
        )
        ids = [tok.token_id async for tok in self.engine.generate(prompt.ids, params, adapter=None, background=True)]
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=True)

    async def aclose(self) -> None:
        pass
