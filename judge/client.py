"""Judge endpoints: any OpenAI-compatible server, or the served base model in-process."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

import aiohttp

from nextstate.core.http_session import LazySession
from nextstate.engine.base import Engine, SamplingParams
from nextstate.modelio.chat_template import ChatRenderer


class JudgeClient(Protocol):
    # Which model answers, as precisely as the client knows: a start-up check of this judge is
    # kept under it (judge/calibration.py), and a different judge is checked anew.
    identity: str

    async def complete(self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int, n: int = 1) -> list[str]:
        """`n` independent answers to `messages` (the m votes of one prompt)."""
        ...

    async def aclose(self) -> None: ...


class JudgeHTTPError(RuntimeError):
    """The judge endpoint answered with an error (the votes it was for are missing)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"judge endpoint answered {status}: {text}")
        self.status = status


class OpenAIJudgeClient:
    """Any OpenAI-compatible chat endpoint (a hosted model, vLLM, SGLang, another nextstate).

    The m votes of a prompt are one request with `n = m` (OpenAI's, vLLM's and SGLang's `n`): the
    prompt is sent, billed and prefilled once, not m times. An endpoint that answers with fewer
    choices is asked again for the rest; one that refuses `n > 1` with a 400 is asked one answer
    at a time from then on.

    A plain aiohttp POST, not the OpenAI SDK: the judge's calls share the event loop with the
    replies users wait for, and the SDK's request and response models cost 2.1 ms of CPU per
    call against 0.9 ms for the same POST through httpx (bench/proxy_overhead's judging-on
    column), and aiohttp is cheaper still (engine/sglang.py). Like the SDK with
    `max_retries=1`, a connection failure, 408, 409, 429 or 5xx is tried once more after a
    short pause."""

    RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))
    RETRY_PAUSE_S = 0.5

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        self.model = model
        self.identity = f"{base_url.rstrip('/')} {model}"
        self.takes_n = True  # until the endpoint refuses n > 1
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._http = LazySession(
            headers={"Authorization": f"Bearer {api_key or 'none'}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        )

    async def complete(self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int, n: int = 1) -> list[str]:
        texts: list[str] = []
        while len(texts) < n:
            want = n - len(texts) if self.takes_n else 1
            try:
                got = await self._post(messages, temperature, max_tokens, want)
            except JudgeHTTPError as exc:
                if exc.status == 400 and want > 1:
                    self.takes_n = False  # e.g. "n > 1 is not supported": one at a time from now on
                    continue
                raise
            if not got:
                raise JudgeHTTPError(200, "the judge endpoint answered with no choices")
            texts += got[: n - len(texts)]
        return texts

    async def _post(self, messages: list[dict[str, str]], temperature: float, max_tokens: int, n: int) -> list[str]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        if n > 1:
            body["n"] = n
        for attempt in range(2):
            try:
                async with self._http.session().post(self._url, data=json.dumps(body)) as response:
                    status, content = response.status, await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                if attempt:
                    raise
            else:
                if status < 400:
                    return [(c.get("message") or {}).get("content") or "" for c in json.loads(content).get("choices") or []]
                if attempt or status not in self.RETRY_STATUSES:
                    raise JudgeHTTPError(status, content[:300].decode(errors="replace"))
            await asyncio.sleep(self.RETRY_PAUSE_S)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.close()


class EngineJudgeClient:
    """The serving engine's base model (no adapter) as its own judge: zero extra setup."""

    def __init__(self, engine: Engine, renderer: ChatRenderer) -> None:
        self.engine = engine
        self.renderer = renderer
        info = engine.info
        self.identity = f"engine {info.model_name} {info.dtype}"

    async def complete(self, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int, n: int = 1) -> list[str]:
        """n generations of one prompt: the engine prefills it once (prefix reuse) and decodes
        them in one batch."""
        prompt = await asyncio.to_thread(self.renderer.render, messages)
        room = self.engine.info.max_context - len(prompt.ids)
        if room < 1:
            raise ValueError(f"judge prompt of {len(prompt.ids)} tokens does not fit the context")
        params = SamplingParams(
            max_new_tokens=min(max_tokens, room), temperature=temperature, stop_token_ids=self.renderer.stop_token_ids
        )

        async def one() -> str:
            ids = [tok.token_id async for tok in self.engine.generate(prompt.ids, params, adapter=None, background=True)]
            return self.renderer.tokenizer.decode(ids, skip_special_tokens=True)

        return list(await asyncio.gather(*(one() for _ in range(n))))

    async def aclose(self) -> None:
        pass
