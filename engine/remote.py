"""What the clients of a model server (SGLang, vLLM) share: HTTP, retries, failures, adapters.

Each server has its own request and answer shapes (engine/sglang.py, engine/vllm.py say which);
what does not depend on them lives here, so both behave the same way to the proxy:

* failures map to clean errors: unreachable → EngineUnavailable (503), too slow →
  EngineTimeout (504), 5xx or an unreadable answer → EngineBadGateway (502), a refusal (4xx) →
  EngineRejected (400). Requests are retried (not after a timeout) only while that is safe:
  before any token reached the caller.
* adapters live in the server's memory only: after the server restarts, a request naming a
  published version fails with the server's unknown-adapter error, and the client loads the
  version again from its path (once per loss, however many requests notice) and retries.
* logprobs, one convention: temperature 1 for sampled and scored tokens alike
  (`EngineInfo.raw_logprobs`); `check_logprobs` refuses at start-up a server that tempers them.

The HTTP client is aiohttp (core/http_session.py), not httpx: every reply is one streamed
request to the server, and httpx's anyio layers cost 1.3-1.6 ms of the proxy's CPU per 33-event
stream against aiohttp's 0.5-0.6 on this box, a third of what the proxy adds per reply
(BENCHMARKS.md, proxy overhead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pydantic_core

from nextstate.core.http_session import LazySession
from nextstate.engine.base import (
    EngineBadGateway,
    EngineError,
    EngineInfo,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    GeneratedToken,
    SamplingParams,
    UnknownAdapterError,
    check_request,
)
from nextstate.engine.sse import read_sse_data

log = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}
# A scoring answer that does not echo the tokens asked about is asked for once more before it is
# an error. The mismatch CI saw on 2026-11-27 (behind SGLang's router) was blamed on a
# prefix-cache race; the one of 2026-12-01 was SGLang echoing the vocabulary's last id as 0
# whenever the start-up probe sampled it (engine/sglang.py, `echoed_ids`, now expected), most
# likely the earlier one's cause too. The second try stays as cheap insurance for an answer
# that really is cut short.
SCORE_TRIES = 2


def model_config(model_dir: Path) -> tuple[int, int]:
    """(max context, vocabulary size) from the model directory's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 4096)), int(config.get("vocab_size", 0))


def once(callback: Callable[[], None] | None) -> Callable[[], None]:
    """`callback`, called at most once however often the result is."""
    called = False

    def call() -> None:
        nonlocal called
        if callback is not None and not called:
            called = True
            callback()

    return call


def json_body(payload: dict[str, Any]) -> bytes:
    """A request body. An agent's prompt is thousands of token ids: pydantic-core's encoder
    writes 4k of them in 0.09 ms against json.dumps' 0.26, on the event loop."""
    return pydantic_core.to_json(payload)


class Retryable(Exception):
    """A failure after which the request may be sent again (if no token reached the caller)."""

    def __init__(self, error: EngineError) -> None:
        self.error = error


def error_message(content: bytes) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, SGLang's
    {"error_message"}, or the text itself."""
    try:
        body = json.loads(content)
    except ValueError:
        return content[:300].decode(errors="replace")
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "error_message" in body:
            return str(body["error_message"])
    return content[:300].decode(errors="replace")


class RemoteEngine:
    """An engine that is a model server's client. Subclasses say how their server is asked
    (`_generate_payload`, `_event_tokens`, `_score_payload`, `_scores`) and how it loads
    adapters (`_server_load`, `_server_unload`)."""

    server: ClassVar[str]  # its name in messages
    generate_path: ClassVar[str]
    score_path: ClassVar[str]
    # What the server says of a request naming an adapter it does not have (it restarted).
    lost_adapter_texts: ClassVar[tuple[str, ...]]
    # How to start the server so that it reports sampled logprobs at temperature 1.
    raw_logprob_remedy: ClassVar[str]
    # True: events after the finishing one add to the last token (`_after_finish`), which is
    # held back until they have come.
    reports_after_finish: ClassVar[bool] = False

    def __init__(
        self,
        base_url: str,
        model_dir: str | Path,
        *,
        timeout_s: float = 300.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        masked_constrained_logprobs: bool = True,
    ) -> None:
        model_dir = Path(model_dir)
        max_context, vocab = model_config(model_dir)
        self.base_url = base_url.rstrip("/")
        self.info = EngineInfo(model_name=model_dir.name, max_context=max_context, device=self.server.lower(),
                               dtype="server", vocab_size=vocab, raw_logprobs=True,
                               masked_constrained_logprobs=masked_constrained_logprobs)
        self.retries = retries
        self.backoff_s = backoff_s
        self._adapters: set[str] = set()
        self._paths: dict[str, str] = {}  # what each loaded adapter was loaded from, to reload it
        self._reloaded: set[str] = set()  # loaded again by this client after the server lost them
        self._reload_lock = asyncio.Lock()
        self._http = LazySession(
            # `timeout_s` bounds each wait for the server's next bytes, not a whole generation
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s),
            # No cap on connections (aiohttp's default is 100): nextstate caps its generations
            # itself (NEXTSTATE_MAX_CONCURRENT_GENERATIONS), and a request past a pool cap would
            # wait for a connection with no timeout at all.
            connection_limit=0,
        )

    @property
    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    async def close(self) -> None:
        await self._http.close()

    async def healthy(self) -> bool:
        try:
            async with self._http.session().get(f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def check_server(self, probe_ids: list[int]) -> None:
        """What nextstate checks of a server at start-up, before it serves anyone."""
        await self.check_logprobs(probe_ids)

    # ---------------------------------------------------------------- generate

    def _generate_payload(self, input_ids: list[int], sampling: SamplingParams, adapter: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def _event_tokens(self, event: dict[str, Any], seen: int, payload: dict[str, Any]) -> tuple[list[GeneratedToken], str | None]:
        """The tokens one streamed event adds after the `seen` ones, and the finish reason if it
        is the last; raises ValueError (or KeyError, TypeError, IndexError) on a shape it does
        not know, and EngineBadGateway on an aborted generation."""
        raise NotImplementedError

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None = None,
        background: bool = False,
        on_admit: Callable[[], None] | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        check_request(self._adapters, adapter, input_ids)
        payload = self._generate_payload(input_ids, sampling, adapter)
        admit = once(on_admit)
        attempt = 0
        reloaded = False
        while True:
            delivered = 0
            try:
                async for token in self._stream(payload, admit):
                    delivered += 1
                    yield token
                return
            except EngineRejected as error:
                if delivered or reloaded or not await self._reload_if_lost(adapter, error):
                    raise
                reloaded = True
                continue
            except Retryable as retry:
                if delivered or attempt >= self.retries:
                    raise retry.error from None
            attempt += 1
            log.warning("%s generate failed, retrying (%d/%d)", self.server, attempt, self.retries)
            await asyncio.sleep(self.backoff_s * attempt)

    def _after_finish(self, event: dict[str, Any], last: GeneratedToken) -> GeneratedToken:
        """The last token, with what an event after the finishing one adds to it (a server whose
        `reports_after_finish` says so: vLLM's cached-prompt count comes in a usage-only event)."""
        return last

    async def _stream(self, payload: dict[str, Any], admit: Callable[[], None]) -> AsyncIterator[GeneratedToken]:
        """The server's stream as tokens. After the finishing event (or `[DONE]`) the body is
        read to its end: left unread, the client closes the connection, and every request would
        pay a new TCP connection to the server (bench/proxy_overhead)."""
        seen = 0
        finished = False
        held: GeneratedToken | None = None  # the last token, while events after it may add to it
        try:
            async with self._http.session().post(f"{self.base_url}{self.generate_path}", data=json_body(payload),
                                                 headers=self._headers(payload)) as response:
                if response.status != 200:
                    error = self._http_error(response.status, await response.read())
                    raise Retryable(error) if isinstance(error, EngineBadGateway) else error
                admit()
                async for data in read_sse_data(response.content.iter_any()):
                    if finished:  # read on to the body's end, so the connection can be reused
                        if held is not None and data != b"[DONE]":
                            held = self._held_with(data, held)
                        elif held is not None:
                            yield held
                            held = None
                        continue
                    if data == b"[DONE]":
                        finished = True
                        continue
                    event = self._parse(data)
                    try:
                        tokens, finish = self._event_tokens(event, seen, payload)
                    except (KeyError, TypeError, ValueError, IndexError) as exc:
                        raise Retryable(EngineBadGateway(f"{self.server} sent an event of unexpected shape: {exc}")) from None
                    for i, token in enumerate(tokens):
                        seen += 1
                        if finish and i == len(tokens) - 1:
                            token = dataclasses.replace(token, finish_reason=finish)
                            if self.reports_after_finish:
                                held = token
                                break
                        yield token
                    finished = finished or bool(finish)
                if held is not None:
                    yield held  # the body ended without [DONE]
                    held = None
                if finished:
                    return
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            if finished:
                if held is not None:
                    yield held
                return  # the generation is whole; only reading on for the connection's sake failed
            if isinstance(exc, asyncio.TimeoutError):
                # not retried: a retry would only multiply the wait the client already had
                raise self._too_slow(exc) from None
            if not isinstance(exc, aiohttp.ClientPayloadError):  # a body broken off is told below
                raise Retryable(self._unreachable(exc)) from None
        raise Retryable(EngineBadGateway(f"{self.server} closed the stream before the generation finished"))

    def _held_with(self, data: bytes, last: GeneratedToken) -> GeneratedToken:
        """`last` with what an event after the finish adds; an unreadable one adds nothing (the
        generation is whole)."""
        try:
            event = json.loads(data)
            return self._after_finish(event, last) if isinstance(event, dict) else last
        except (ValueError, KeyError, TypeError, AttributeError):
            return last

    def _parse(self, data: bytes) -> dict[str, Any]:
        try:
            event = json.loads(data)
        except ValueError:
            raise Retryable(EngineBadGateway(f"{self.server} sent unreadable data: {data[:200].decode(errors='replace')!r}")) from None
        if not isinstance(event, dict):
            raise Retryable(EngineBadGateway(f"{self.server} sent an event that is not an object"))
        if "error" in event:
            # a request the server refused after it had answered 200, or a failure mid-stream
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            message = error.get("message", error) if isinstance(error, dict) else error
            if isinstance(code, int) and 400 <= code < 500:
                raise EngineRejected(f"{self.server} refused the request ({code}): {message}")
            raise EngineBadGateway(f"{self.server} reported an error: {message}")
        return event

    # ---------------------------------------------------------------- score

    def _score_payload(self, input_ids: list[int], start: int, adapter: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def _scores(self, body: dict[str, Any], input_ids: list[int], start: int) -> list[float]:
        """One logprob per token of input_ids[start:] from the scoring answer; raises ValueError
        (or KeyError, TypeError, IndexError) on a shape it does not know."""
        raise NotImplementedError

    async def score(
        self,
        input_ids: list[int],
        start: int,
        adapter: str | None = None,
        temperature: float = 1.0,
        background: bool = False,
    ) -> list[float]:
        check_request(self._adapters, adapter, input_ids, start)
        if temperature != 1.0:
            raise ValueError(f"{self.server} scores at temperature 1 only (asked for {temperature:g}); see engine/remote.py")
        payload = self._score_payload(input_ids, start, adapter)
        problem = ""
        for attempt in range(SCORE_TRIES):
            try:
                body = await self._post(self.score_path, payload, retry=True)
            except EngineRejected as error:
                if not await self._reload_if_lost(adapter, error):
                    raise
                body = await self._post(self.score_path, payload, retry=True)
            try:
                scored = self._scores(body, input_ids, start)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                problem = f"{self.server} sent a scoring answer of unexpected shape: {exc}"
            else:
                if len(scored) == len(input_ids) - start:
                    return scored
                problem = f"{self.server} scored {len(scored)} tokens, not the {len(input_ids) - start} of input_ids[{start}:]"
            if attempt + 1 < SCORE_TRIES:
                log.warning("%s; asking once more", problem)
        raise EngineBadGateway(problem)

    async def check_logprobs(self, probe_ids: list[int], tolerance: float = 0.05) -> None:
        """Refuse a server whose sampled-token logprobs are tempered.

        Samples a few tokens at temperature 0.5 and scores the same tokens as prompt tokens
        (always at temperature 1): raw sampled logprobs agree with those, tempered ones do not.
        Fully peaked tokens agree either way, so a probe without spread proves nothing and
        passes."""
        params = SamplingParams(max_new_tokens=8, temperature=0.5, seed=0)
        tokens = [t async for t in self.generate(probe_ids, params)]
        if not tokens:
            return
        scored = await self.score(probe_ids + [t.token_id for t in tokens], len(probe_ids))
        gap = sum(abs(t.logprob - s) for t, s in zip(tokens, scored)) / len(tokens)
        if gap > tolerance:
            raise EngineError(
                f"{self.server} at {self.base_url} reports sampled-token logprobs after temperature scaling (mean gap "
                f"{gap:.3f} from its temperature-1 scores): nextstate needs both at temperature 1. {self.raw_logprob_remedy}"
            )

    # ---------------------------------------------------------------- adapters

    async def _server_load(self, name: str, path: str, retry: bool) -> str | None:
        """Ask the server to load `path` as `name`: None once it serves that path under that
        name (also when it had it already), else why not."""
        raise NotImplementedError

    async def _server_unload(self, name: str) -> str | None:
        """Ask the server to unload `name`: None once done, else why not."""
        raise NotImplementedError

    async def load_adapter(self, name: str, path: str) -> None:
        """Load `path` as `name`. The server may have it already — nextstate restarted while the
        server ran on — which is the same adapter when it holds that name for the same path: a
        version's name is never given to other weights (learner/versions.py)."""
        failure = await self._server_load(name, str(path), retry=False)
        if failure is not None:
            raise EngineError(f"{self.server} could not load adapter {name!r}: {failure}")
        self._adapters.add(name)
        self._paths[name] = str(path)

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        # Remove it from routing first; the server itself finishes requests still using it.
        self._adapters.discard(name)
        self._paths.pop(name, None)
        self._reloaded.discard(name)
        failure = await self._server_unload(name)
        if failure is not None:
            raise EngineError(f"{self.server} could not unload adapter {name!r}: {failure}")

    async def release_adapter(self, name: str) -> None:
        """Stop sending `name`. The server keeps it — another process (the learner that
        published it) unloads it there once its requests are done — unless this client loaded it
        there again after it was gone (a request named it just after the learner's unload): then
        this client unloads it too, or nobody would."""
        if name in self._reloaded and name in self._adapters:
            await self.unload_adapter(name)
        self._adapters.discard(name)
        self._paths.pop(name, None)
        self._reloaded.discard(name)

    def _adapter_lost(self, error: Exception) -> bool:
        return any(text in str(error) for text in self.lost_adapter_texts)

    async def _reload_if_lost(self, adapter: str | None, error: EngineRejected) -> bool:
        """The server lost an adapter this engine loaded (it restarted): load it again, once per
        loss, and say whether the request should be retried. Adapters live in the server's
        memory only, so after its restart every request on a published version would fail."""
        if adapter is None or adapter not in self._paths or not self._adapter_lost(error):
            return False
        async with self._reload_lock:  # many requests notice at once; one reload serves them all
            failure = await self._server_load(adapter, self._paths[adapter], retry=True)
        if failure is not None:
            log.error("%s lost adapter %s and could not load it again: %s", self.server, adapter, failure)
            return False
        log.warning("%s had lost adapter %s (restarted?); loaded it again from %s", self.server, adapter, self._paths[adapter])
        self._reloaded.add(adapter)
        return True

    async def _models(self, base_url: str | None = None) -> list[dict[str, Any]] | None:
        """The server's (or `base_url`'s, one of its workers) OpenAI-style /v1/models entries;
        None if it cannot say."""
        try:
            async with self._http.session().get(f"{base_url or self.base_url}/v1/models") as response:
                models = (await response.json()).get("data", []) if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
            log.warning("could not list %s's models: %s", self.server, exc)
            return None
        return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else None

    async def served_adapters(self, base_url: str | None = None) -> dict[str, str] | None:
        """name → path of the adapters the server (or `base_url`, one of its workers) holds: an
        adapter is a model with a parent, and its path is the root; None if it cannot say."""
        models = await self._models(base_url)
        if models is None:
            return None
        return {m["id"]: m["root"] for m in models if m.get("parent") and m.get("id") and m.get("root")}

    async def unload_leftovers(self, root: Path, keep: set[str]) -> list[str]:
        """Unload what the server holds from under `root` (nextstate's adapters) that this engine
        did not load: versions an earlier nextstate process loaded and did not get to unload (it
        crashed, or the server outlived it). A long-running server would otherwise keep one per
        restart. Returns the names unloaded; a failure is logged, never raised."""
        held = await self.served_adapters()
        if not held:
            return []
        root = root.resolve()
        gone = []
        for name, path in held.items():
            if name in keep or name in self._adapters:
                continue
            if not Path(path).resolve().is_relative_to(root):
                continue  # someone else's adapter on a shared server
            try:
                failure = await self._server_unload(name)
            except EngineError as exc:
                failure = str(exc)
            if failure is None:
                gone.append(name)
            else:
                log.warning("could not unload leftover adapter %s: %s", name, failure)
        if gone:
            log.info("unloaded %d adapter(s) an earlier nextstate left in %s: %s", len(gone), self.server, ", ".join(gone))
        return gone

    # ---------------------------------------------------------------- plumbing

    def _headers(self, payload: dict[str, Any]) -> dict[str, str]:
        """The headers of a request carrying `payload` (a router in front reads some)."""
        return JSON_HEADERS

    async def _request(self, path: str, payload: dict[str, Any], retry: bool, base_url: str | None = None) -> tuple[int, bytes]:
        """POST `payload` to the server (or to `base_url`, one of its workers); the status and
        body of any answer below 500. Unreachable and 5xx are retried when `retry`, then raised."""
        attempt = 0
        while True:
            try:
                async with self._http.session().post(f"{base_url or self.base_url}{path}", data=json_body(payload),
                                                     headers=self._headers(payload)) as response:
                    status, content = response.status, await response.read()
                if status < 500:
                    return status, content
                error: EngineError = self._http_error(status, content)
            except asyncio.TimeoutError as exc:
                error = self._too_slow(exc)
            except aiohttp.ClientError as exc:
                error = self._unreachable(exc)
            if not retry or attempt >= self.retries or not isinstance(error, (EngineUnavailable, EngineBadGateway)):
                raise error
            attempt += 1
            await asyncio.sleep(self.backoff_s * attempt)

    async def _post(self, path: str, payload: dict[str, Any], retry: bool, ok_400: bool = False,
                    base_url: str | None = None) -> dict[str, Any]:
        """POST `payload` and read the JSON object answered with 200 (or 400, when `ok_400`: a
        refusal whose body says why)."""
        status, content = await self._request(path, payload, retry, base_url)
        if status != 200 and not (ok_400 and status == 400):
            raise self._http_error(status, content)
        try:
            body = json.loads(content)
        except ValueError as exc:
            raise EngineBadGateway(f"{self.server} sent an unreadable answer: {exc}") from None
        if not isinstance(body, dict):
            raise EngineBadGateway(f"{self.server} sent an answer that is not a JSON object")
        return body

    def _http_error(self, status: int, content: bytes) -> EngineError:
        text = content[:300].decode(errors="replace")
        if status >= 500:
            return EngineBadGateway(f"{self.server} answered {status}: {text}")
        return EngineRejected(f"{self.server} refused the request ({status}): {text}")

    def _unreachable(self, exc: Exception) -> EngineUnavailable:
        return EngineUnavailable(f"{self.server} at {self.base_url} is unreachable: {exc!r}")

    def _too_slow(self, exc: Exception) -> EngineTimeout:
        return EngineTimeout(f"{self.server} did not answer in time: {exc!r}")
