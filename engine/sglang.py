"""The production engine: an SGLang server driven through its native HTTP API.

Targets SGLang's `/generate` (token ids in, token ids and logprobs out, streaming), and
`/load_lora_adapter` / `/unload_lora_adapter` for named adapters; launch SGLang with
`--enable-lora`, `--max-lora-rank` and `--lora-target-modules` matching the learner (see
deploy/). Shapes used, from SGLang's io_struct / tokenizer manager:

* request: `input_ids`, `sampling_params` {max_new_tokens, temperature, top_p, stop_token_ids,
  no_stop_trim, sampling_seed}, `return_logprob`, `top_logprobs_num`, `logprob_start_len`,
  `stream`, `lora_path` (always sent: null means the base model, on purpose).
* response: `output_ids`, `meta_info` {finish_reason: null | {type: stop|length|abort, ...},
  prompt_tokens, completion_tokens, output_token_logprobs: [[logprob, token_id, text|null]],
  output_top_logprobs, input_token_logprobs}. Streaming sends `data: {json}` events ending in
  `data: [DONE]`; each event holds everything so far, or only the new tokens when SGLang runs
  with --incremental-streaming-output; both are handled.
* scoring: `max_new_tokens: 0` with `logprob_start_len = start − 1`; `input_token_logprobs`
  then covers input_ids[start − 1:], and its first entry (that position's own logprob) is
  always null, so it is dropped: one logprob per scored token, aligned.
* logprobs, one convention: **temperature 1** ("raw"), for sampled and scored tokens alike.
  Stock SGLang takes prompt-token logprobs (what scoring reads) at temperature 1 whatever the
  request says, and sampled-token logprobs after temperature scaling unless the server runs
  with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`. With that variable set (deploy/ sets it) both are
  raw, so a turn's old logprobs and its OPD teacher's are on the same footing; its
  `logprob_temperature` is 1 and the learner computes its own at 1 too. `check_logprobs` finds
  a server without the variable at start-up and refuses it, rather than mixing temperatures.

* adapters (as SGLang 0.5.23 behaves, tests/test_sglang_contract.py): a name once loaded is never
  forgotten — after `/unload_lora_adapter` a request naming it loads it again from its path, and
  loading that name again is refused as "already loaded" — so nextstate never sends a name it
  unloaded, and never gives a name to other weights (learner/versions.py: names carry a digest of
  the weights). A request naming an adapter SGLang never had (it restarted) fails with "has never
  been loaded", as a 400 or, streamed, as an error event after HTTP 200; the client loads it again.
* under a JSON-schema constraint the sampled logprobs come back after the grammar mask,
  renormalised (`EngineInfo.masked_constrained_logprobs`): the proxy scores such a reply again.

Failures map to clean errors: unreachable → EngineUnavailable (503), too slow → EngineTimeout
(504), 5xx or an unreadable answer → EngineBadGateway (502). Requests are retried (not after a
timeout) only while that is safe: before any token reached the caller.

The HTTP client is aiohttp (core/http_session.py), not httpx: every reply is one streamed
request to SGLang, and httpx's anyio layers cost 1.3-1.6 ms of
the proxy's CPU per 33-event stream against aiohttp's 0.5-0.6 on this box, a third of what the
proxy adds per reply (BENCHMARKS.md, proxy overhead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

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

TARGET_SGLANG = "0.5.23 (tested for real by .ci/real-engines); other 0.5.x releases share the native /generate API"


def _model_info(model_dir: Path) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings", 4096)), int(config.get("vocab_size", 0))


def _once(callback: Callable[[], None] | None) -> Callable[[], None]:
    """`callback`, called at most once however often the result is."""
    called = False

    def call() -> None:
        nonlocal called
        if callback is not None and not called:
            called = True
            callback()

    return call


# What SGLang answers for a request naming an adapter it does not have: 0.5.23's tokenizer
# manager says "Got LoRA adapter that has never been loaded: NAME" (a 400, or on a stream an
# HTTP 200 whose first event is {"error": {..., "code": 400}}); earlier 0.5 releases said "The
# following requested LoRA adapters are not loaded: NAME".
LOST_ADAPTER = ("has never been loaded", "LoRA adapters are not loaded")


def _adapter_lost(error: Exception) -> bool:
    return any(text in str(error) for text in LOST_ADAPTER)


_JSON = {"content-type": "application/json"}


def _json_body(payload: dict[str, Any]) -> bytes:
    """The request body. An agent's prompt is thousands of token ids: pydantic-core's encoder
    writes 4k of them in 0.09 ms against json.dumps' 0.26, on the event loop."""
    return pydantic_core.to_json(payload)


def _unreachable(base_url: str, exc: Exception) -> EngineUnavailable:
    return EngineUnavailable(f"SGLang at {base_url} is unreachable: {exc!r}")


def _too_slow(exc: Exception) -> EngineTimeout:
    return EngineTimeout(f"SGLang did not answer in time: {exc!r}")


class _Retryable(Exception):
    def __init__(self, error: EngineError) -> None:
        self.error = error


class SGLangEngine:
    def __init__(
        self,
        base_url: str,
        model_dir: str | Path,
        *,
        timeout_s: float = 300.0,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        model_dir = Path(model_dir)
        max_context, vocab = _model_info(model_dir)
        self.base_url = base_url.rstrip("/")
        self.info = EngineInfo(model_name=model_dir.name, max_context=max_context, device="sglang", dtype="server",
                               vocab_size=vocab, raw_logprobs=True, masked_constrained_logprobs=True)
        self.retries = retries
        self.backoff_s = backoff_s
        self._adapters: set[str] = set()
        self._paths: dict[str, str] = {}  # what each loaded adapter was loaded from, to reload it
        self._reload_lock = asyncio.Lock()
        self._http = LazySession(
            # `timeout_s` bounds each wait for SGLang's next bytes, not a whole generation
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

    # ---------------------------------------------------------------- generate

    def _payload(self, input_ids: list[int], sampling: SamplingParams, adapter: str | None, stream: bool) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids),
            # keep the stop token in output_ids: it was sampled, and the learner trains on it
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.json_schema is not None:
            params["json_schema"] = sampling.json_schema  # SGLang's own grammar backend
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": stream,
            "lora_path": adapter,
        }
        if sampling.top_logprobs:
            payload["top_logprobs_num"] = sampling.top_logprobs
        if sampling.cache_salt is not None:
            # its radix cache matches prefixes only within one salt (io_struct's cache_salt)
            payload["cache_salt"] = sampling.cache_salt
        return payload

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None = None,
        background: bool = False,
        on_admit: Callable[[], None] | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        check_request(self._adapters, adapter, input_ids)
        payload = self._payload(input_ids, sampling, adapter, stream=True)
        admit = _once(on_admit)
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
            except _Retryable as retry:
                if delivered or attempt >= self.retries:
                    raise retry.error from None
            attempt += 1
            log.warning("SGLang generate failed, retrying (%d/%d)", attempt, self.retries)
            await asyncio.sleep(self.backoff_s * attempt)

    async def _stream(self, payload: dict[str, Any], admit: Callable[[], None]) -> AsyncIterator[GeneratedToken]:
        """SGLang's stream as tokens. After the finishing event (or `[DONE]`) the body is read to
        its end: left unread, the client closes the connection, and every request would pay a
        new TCP connection to SGLang (bench/proxy_overhead)."""
        seen = 0
        finished = False
        try:
            async with self._http.session().post(f"{self.base_url}/generate", data=_json_body(payload), headers=_JSON) as response:
                if response.status != 200:
                    error = self._http_error(response.status, await response.read())
                    raise _Retryable(error) if isinstance(error, EngineBadGateway) else error
                admit()
                async for data in read_sse_data(response.content.iter_any()):
                    if data == b"[DONE]" or finished:
                        finished = True
                        continue  # read on to the body's end, so the connection can be reused
                    event = self._parse(data)
                    tokens, finish = self._new_tokens(event, seen)
                    if not seen and tokens and isinstance(event["meta_info"].get("cached_tokens"), int):
                        tokens[0] = dataclasses.replace(tokens[0], cached_prompt_tokens=event["meta_info"]["cached_tokens"])
                    for i, token in enumerate(tokens):
                        seen += 1
                        last = i == len(tokens) - 1
                        yield dataclasses.replace(token, finish_reason=finish) if last and finish else token
                    finished = finished or bool(finish)
                if finished:
                    return
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            if finished:
                return  # the generation is whole; only reading on for the connection's sake failed
            if isinstance(exc, asyncio.TimeoutError):
                # not retried: a retry would only multiply the wait the client already had
                raise _too_slow(exc) from None
            if not isinstance(exc, aiohttp.ClientPayloadError):  # a body broken off is told below
                raise _Retryable(_unreachable(self.base_url, exc)) from None
        raise _Retryable(EngineBadGateway("SGLang closed the stream before the generation finished"))

    @staticmethod
    def _parse(data: bytes) -> dict[str, Any]:
        try:
            event = json.loads(data)
        except ValueError:
            raise _Retryable(EngineBadGateway(f"SGLang sent unreadable data: {data[:200].decode(errors='replace')!r}")) from None
        if not isinstance(event, dict):
            raise _Retryable(EngineBadGateway("SGLang sent an event that is not an object"))
        if "error" in event:
            # a request SGLang refused after it had answered 200 (the stream's first event)
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            message = error.get("message", error) if isinstance(error, dict) else error
            if isinstance(code, int) and 400 <= code < 500:
                raise EngineRejected(f"SGLang refused the request ({code}): {message}")
            raise EngineBadGateway(f"SGLang reported an error: {message}")
        return event

    @staticmethod
    def _new_tokens(event: dict[str, Any], seen: int) -> tuple[list[GeneratedToken], str | None]:
        """The tokens this event adds, and the finish reason if it is the last."""
        try:
            meta = event["meta_info"]
            ids = list(event["output_ids"])
            logprobs = meta.get("output_token_logprobs") or []
            tops = meta.get("output_top_logprobs") or []
            # Cumulative events (SGLang's default) repeat everything so far; incremental ones
            # (--incremental-streaming-output) carry only new tokens. completion_tokens is
            # always the running total, which tells them apart.
            total = int(meta.get("completion_tokens", len(ids)))
            if len(ids) == total:
                ids, logprobs, tops = ids[seen:], logprobs[seen:], tops[seen:]
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
            tokens = []
            for k, (token_id, entry) in enumerate(zip(ids, logprobs)):
                if int(entry[1]) != int(token_id):
                    raise ValueError(f"logprob entry for token {entry[1]} where {token_id} was sampled")
                top = tuple((int(t[1]), float(t[0])) for t in (tops[k] or [])) if k < len(tops) else ()
                tokens.append(GeneratedToken(int(token_id), float(entry[0]), top))
            reason = meta.get("finish_reason")
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise _Retryable(EngineBadGateway(f"SGLang sent an event of unexpected shape: {exc}")) from None
        if reason is None:
            return tokens, None
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "abort":
            raise EngineBadGateway(f"SGLang aborted the generation: {reason.get('message', reason)}")
        return tokens, ("length" if kind == "length" else "stop")

    # ---------------------------------------------------------------- score

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
            raise ValueError(f"SGLang scores at temperature 1 only (asked for {temperature:g}); see the module docstring")
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "stream": False,
            "lora_path": adapter,
        }
        try:
            body = await self._post("/generate", payload, retry=True)
        except EngineRejected as error:
            if not await self._reload_if_lost(adapter, error):
                raise
            body = await self._post("/generate", payload, retry=True)
        try:
            entries = body["meta_info"]["input_token_logprobs"][1:]
            scored = [float(e[0]) for e in entries]
            ids = [int(e[1]) for e in entries]
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EngineBadGateway(f"SGLang sent a scoring answer of unexpected shape: {exc}") from None
        if ids != list(input_ids[start:]):
            raise EngineBadGateway(f"SGLang scored {len(ids)} tokens that are not input_ids[{start}:]")
        return scored

    async def check_logprobs(self, probe_ids: list[int], tolerance: float = 0.05) -> None:
        """Refuse a server whose sampled-token logprobs are tempered (SGLang's default).

        Samples a few tokens at temperature 0.5 and scores the same tokens as prompt tokens
        (always at temperature 1 in SGLang): raw sampled logprobs agree with those, tempered ones
        do not. Fully peaked tokens agree either way, so a probe without spread proves nothing
        and passes."""
        params = SamplingParams(max_new_tokens=8, temperature=0.5, seed=0)
        tokens = [t async for t in self.generate(probe_ids, params)]
        if not tokens:
            return
        scored = await self.score(probe_ids + [t.token_id for t in tokens], len(probe_ids))
        gap = sum(abs(t.logprob - s) for t, s in zip(tokens, scored)) / len(tokens)
        if gap > tolerance:
            raise EngineError(
                f"SGLang at {self.base_url} reports sampled-token logprobs after temperature scaling (mean gap "
                f"{gap:.3f} from its temperature-1 scores): nextstate needs both at temperature 1. Start SGLang with "
                "SGLANG_RETURN_ORIGINAL_LOGPROB=1 in its environment (deploy/launch.sh and compose.yaml do)."
            )

    # ---------------------------------------------------------------- adapters

    async def load_adapter(self, name: str, path: str) -> None:
        """Load `path` as `name`. SGLang may have it already — nextstate restarted while SGLang ran
        on — which is the same adapter when SGLang holds that name for the same path: a version's
        name is never given to other weights (learner/versions.py), and SGLang never forgets a
        name (an unloaded adapter is loaded again from its path when a request names it)."""
        body = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, retry=False, ok_400=True)
        loaded = body.get("loaded_adapters")
        held = loaded.get(name) if isinstance(loaded, dict) else None  # the path SGLang has under this name
        if not body.get("success", False) and not ("already loaded" in str(body.get("error_message", "")) and held == str(path)):
            raise EngineError(f"SGLang could not load adapter {name!r}: {body.get('error_message', body)}")
        self._adapters.add(name)
        self._paths[name] = str(path)

    async def _reload_if_lost(self, adapter: str | None, error: EngineRejected) -> bool:
        """SGLang lost an adapter this engine loaded (it restarted): load it again, once per
        loss, and say whether the request should be retried. Adapters live in SGLang's memory
        only, so after its restart every request on a published version would fail otherwise."""
        if adapter is None or adapter not in self._paths or not _adapter_lost(error):
            return False
        async with self._reload_lock:  # many requests notice at once; one reload serves them all
            body = await self._post("/load_lora_adapter", {"lora_name": adapter, "lora_path": self._paths[adapter]},
                                    retry=True, ok_400=True)
            message = str(body.get("error_message", ""))
            if not body.get("success", False) and "already" not in message.lower():
                log.error("SGLang lost adapter %s and could not load it again: %s", adapter, message)
                return False
        log.warning("SGLang had lost adapter %s (restarted?); loaded it again from %s", adapter, self._paths[adapter])
        return True

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        # Remove it from routing first; SGLang itself waits for requests still using it.
        self._adapters.discard(name)
        self._paths.pop(name, None)
        body = await self._post("/unload_lora_adapter", {"lora_name": name}, retry=False, ok_400=True)
        if not body.get("success", False):
            raise EngineError(f"SGLang could not unload adapter {name!r}: {body.get('error_message', body)}")

    async def unload_leftovers(self, root: Path, keep: set[str]) -> list[str]:
        """Unload what SGLang holds from under `root` (nextstate's adapters) that this engine did
        not load: versions an earlier nextstate process loaded and did not get to unload (it
        crashed, or SGLang outlived it). A long-running SGLang would otherwise keep one per
        restart. Returns the names unloaded; a failure is logged, never raised."""
        try:
            async with self._http.session().get(f"{self.base_url}/v1/models") as response:
                models = (await response.json()).get("data", []) if response.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("could not list SGLang's adapters to unload leftovers: %s", exc)
            return []
        root = root.resolve()
        gone = []
        for model in models:
            name, path = model.get("id"), model.get("root")
            if not model.get("parent") or name in keep or name in self._adapters or not path:
                continue
            if not Path(path).resolve().is_relative_to(root):
                continue  # someone else's adapter on a shared server
            try:
                body = await self._post("/unload_lora_adapter", {"lora_name": name}, retry=False, ok_400=True)
            except EngineError as exc:
                log.warning("could not unload leftover adapter %s: %s", name, exc)
                continue
            if body.get("success", False):
                gone.append(name)
        if gone:
            log.info("unloaded %d adapter(s) an earlier nextstate left in SGLang: %s", len(gone), ", ".join(gone))
        return gone

    # ---------------------------------------------------------------- plumbing

    async def _post(self, path: str, payload: dict[str, Any], retry: bool, ok_400: bool = False) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                async with self._http.session().post(f"{self.base_url}{path}", data=_json_body(payload), headers=_JSON) as response:
                    status, content = response.status, await response.read()
                if status == 200 or (ok_400 and status == 400):
                    body = json.loads(content)
                    if not isinstance(body, dict):
                        raise ValueError("not a JSON object")
                    return body
                error: EngineError = self._http_error(status, content)
            except asyncio.TimeoutError as exc:
                error = _too_slow(exc)
            except aiohttp.ClientError as exc:
                error = _unreachable(self.base_url, exc)
            except ValueError as exc:
                error = EngineBadGateway(f"SGLang sent an unreadable answer: {exc}")
            if not retry or attempt >= self.retries or not isinstance(error, (EngineUnavailable, EngineBadGateway)):
                raise error
            attempt += 1
            await asyncio.sleep(self.backoff_s * attempt)

    @staticmethod
    def _http_error(status: int, content: bytes) -> EngineError:
        text = content[:300].decode(errors="replace")
        if status >= 500:
            return EngineBadGateway(f"SGLang answered {status}: {text}")
        return EngineRejected(f"SGLang refused the request ({status}): {text}")
