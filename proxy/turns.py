"""One reply, whatever API asked for it: prepare → generate → commit.

Every API front end (chat completions, Messages, Responses) converts its request into a `TurnRequest`, the
one internal form of "a conversation that wants the next assistant message". `TurnService`
then does the API-neutral work: it checks the model and the context budget, renders the prompt
to token ids, classifies the request into a session (main or side turn), picks the policy that
serves the user, runs the decode loop against the engine, and on the last token commits the
turn: exactly the prompt ids, sampled ids and sampling logprobs, handed to the session, where
the next request of that session turns them into a transition for the judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nextstate.core.activity import Activity
from nextstate.core.memory import resident_bytes
from nextstate.core.metrics import Metrics
from nextstate.core.policy import PolicyDirectory, PolicyRef
from nextstate.core.records import RecordWriter
from nextstate.core.types import Turn
from nextstate.engine.base import Engine, EngineError, SamplingParams
from nextstate.modelio.chat_template import ChatRenderer, RenderedPrompt
from nextstate.modelio.tool_calls import forced_call_schema
from nextstate.proxy.decode import Admitted, Decoder, Delta, Finished, StillWorking, TurnEvent
from nextstate.proxy.errors import ApiError, engine_error, invalid_request, server_error
from nextstate.core.stores.keys import ApiKey
from nextstate.core.stores.parallel_slots import LocalSlots, Slots
from nextstate.proxy.prefix_warmup import PrefixWarmup
from nextstate.proxy.rate_limits import RateLimiter
from nextstate.proxy.sessions import SessionStore, TurnPlan
from nextstate.proxy.wire import TurnHints

log = logging.getLogger(__name__)


# Prompts tokenized at once: each holds its text, the template's rendering and the ids in memory
# (a prompt at the byte bound of `ChatRenderer.fewest_tokens` costs tens of MB), and two keep
# two cores busy.
RENDER_CONCURRENCY = 2


def cache_salt(key: ApiKey) -> str:
    """The user's prefix-cache partition, named without their name (it reaches the engine).
    It changes with `user_since`: a forgotten user's cached prefixes are out of reach of a new
    user given the same name, on every engine, with nothing to delete anywhere."""
    return hashlib.sha256(f"nextstate-cache:{key.user}:{key.user_since}".encode()).hexdigest()[:24]

_END = object()  # in a turn's token queue: the engine finished
_QUIET = object()  # in a turn's token queue: `keepalive_s` passed without a token


def _is_token(item: object) -> bool:
    return item is not _END and item is not _QUIET and not isinstance(item, (BaseException, Admitted))


# The fewest reply tokens a request whose limit runs past the window is still served with.
ROOM_FOR_A_REPLY = 256


@dataclass(frozen=True)
class TurnRequest:
    """A conversation that wants the next assistant message, in OpenAI chat's plain-dict shapes."""

    model: str
    messages: list[dict[str, Any]]
    hints: TurnHints
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    parallel_tool_calls: bool = True
    # With no max_tokens, the reply may take the rest of the window (OpenAI's Responses API, which
    # Codex counts on: it sends no limit and takes a reply cut short for an error) rather than
    # NEXTSTATE_DEFAULT_MAX_TOKENS.
    unlimited: bool = False
    # Structured output: the JSON schema (as JSON text) the reply is decoded under
    # (modelio/structured_output.py); only when no tool may be called, since a reply held to
    # the schema from its first token could never be a tool call.
    reply_schema: str | None = None
    # The reply's id is the one its API gives (`chatcmpl-…`, Messages' `msg_…`, Responses'
    # `resp_…`): the turn keeps the id its client got, so `POST /v1/feedback` can name it.
    id_prefix: str = "chatcmpl-"

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))


@dataclass
class PreparedTurn:
    request: TurnRequest
    key: ApiKey
    prompt: RenderedPrompt
    sampling: SamplingParams
    plan: TurnPlan
    # The version that serves the turn: looked up right before the engine and set when the
    # engine admits the request (`Admitted.policy`); None until then. One lookup, one moment:
    # a swap between preparing and generating must not leave parts of a reply naming another.
    policy: PolicyRef | None = None
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))  # `prepare` gives the API's prefix
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)
    extra_headers: dict[str, str] = field(default_factory=dict)  # the key's rate-limit standing


class TurnService:
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
        keepalive_s: float = 5.0,
        limiter: RateLimiter | None = None,
        max_parallel_per_user: int = 4,
        slots: Slots | None = None,
        max_memory_bytes: int | None = None,
        harness_max_tokens: int = 0,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.sessions = sessions
        self.records = records
        self.policies = policies
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.harness_max_tokens = harness_max_tokens
        # a new version reads its users' conversations before they next write (proxy/prefix_warmup.py)
        self.warmup = PrefixWarmup(engine, sessions, policies, list(renderer.stop_token_ids))
        self._rendering = asyncio.Semaphore(RENDER_CONCURRENCY)
        self.max_memory_bytes = max_memory_bytes
        self.activity = activity or Activity()
        self.keepalive_s = keepalive_s
        self.limiter = limiter or RateLimiter()
        self.max_parallel_per_user = max_parallel_per_user
        self.slots = slots or LocalSlots()  # replies being generated, per user

    # ------------------------------------------------------------------ preparation

    async def prepare(self, request: TurnRequest, key: ApiKey) -> PreparedTurn:
        prompt = await self.render(request, key.user)
        sampling = self._sampling(request, len(prompt.ids), key)
        if key.tpm and request.max_tokens is None:
            # no max_tokens asked: the reply may take what the key's per-minute budget leaves
            room = max(1, min(sampling.max_new_tokens, key.tpm - len(prompt.ids)))
            sampling = dataclasses.replace(sampling, max_new_tokens=room)
        quota = await self.limiter.admit(key, len(prompt.ids), sampling.max_new_tokens)
        hints = request.hints
        chain = self.sessions.chain(key.user, request.messages)
        await self.sessions.refresh(key.user, chain, hints.session_id)  # served by another process lately?
        plan = self.sessions.resolve(
            key.user, request.messages, session_id=hints.session_id, turn_type=hints.turn_type, done=hints.done,
            request=chain,
        )
        if plan.harness and 0 < self.harness_max_tokens < sampling.max_new_tokens:
            # the agent's own summary: a short one frees its context, a long one (a small model's
            # run on to the limit) is what fills it again; and it is minutes less on a CPU
            sampling = dataclasses.replace(sampling, max_new_tokens=self.harness_max_tokens)
        self.metrics.turns.labels(plan.turn_type, plan.match).inc()
        self.metrics.sessions_open.set(len(self.sessions))
        prep = PreparedTurn(request, key, prompt, sampling, plan, id=request.id_prefix + secrets.token_hex(12))
        prep.extra_headers.update(quota.headers)
        return prep

    async def render(self, request: TurnRequest, user: str | None = None) -> RenderedPrompt:
        """The prompt the model would read for `request` of `user`'s (nothing else happens). The first step
        of every request that reaches the model or its tokenizer: where new work is refused
        while the server is short of memory, and prompts too long to fit are found untokenized."""
        if self.max_memory_bytes and (held := resident_bytes()) > self.max_memory_bytes:
            # new work waits; what runs finishes (killed by the kernel, everyone's replies would go)
            raise ApiError(
                503, f"The server is short of memory ({held / 2**30:.1f} GiB in use, "
                f"NEXTSTATE_MAX_MEMORY_MB {self.max_memory_bytes // 2**20}); try again shortly.",
                type="server_error", code="server_overloaded", headers={"retry-after": "5"},
            )
        if request.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{request.model}' does not exist here; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )
        limit = self.engine.info.max_context
        fewest = self.renderer.fewest_tokens(request.messages, request.tools)
        if fewest > limit:  # known without tokenizing: a token spells at most max_token_bytes
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, your messages are at least "
                f"{fewest} tokens long ({self.renderer.max_token_bytes} bytes a token at most). Please reduce the "
                "length of the messages.", param="messages", code="context_length_exceeded",
            )
        async with self._rendering:
            return await asyncio.to_thread(self.renderer.render, request.messages, request.tools, request.tool_choice, user)

    def _sampling(self, request: TurnRequest, prompt_len: int, key: ApiKey) -> SamplingParams:
        limit = self.engine.info.max_context
        room = limit - prompt_len
        requested = request.max_tokens
        # A limit past the window gets what the window leaves (as llama.cpp's and Ollama's
        # servers do: coding agents ask for 32k on any model), unless that is too little to be
        # a reply an agent can use: then the error that makes an agent compact or say so.
        if room < 1:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, your messages are {prompt_len} "
                "tokens long. Please reduce the length of the messages.", param="messages", code="context_length_exceeded",
            )
        if requested is not None and room < min(requested, ROOM_FOR_A_REPLY):
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, "
                f"{requested} in the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        wanted = requested or (room if request.unlimited else self.default_max_tokens)
        return SamplingParams(
            max_new_tokens=min(wanted, room),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop_token_ids=self.renderer.stop_token_ids,
            top_logprobs=request.top_logprobs or 0,
            json_schema=(forced_call_schema(request.tools or [], request.tool_choice) if request.forced_tool_call
                         else None if request.parse_tools else request.reply_schema),
            # one prefix-cache partition per user: a hit must not tell them what others sent
            cache_salt=cache_salt(key),
        )

    # ------------------------------------------------------------------ generation

    async def run(self, prep: PreparedTurn) -> AsyncIterator[TurnEvent]:
        """The decode loop: `Admitted` once the engine took the request, deltas as tokens
        arrive (`StillWorking` after `keepalive_s` without one), then the finished reply,
        committed. An engine failure before admission raises before anything is yielded; a
        failure after it is recorded (a 'failed' record and count) and raised."""
        slot = await self.slots.take(prep.key.user, self.max_parallel_per_user)
        if slot is None:
            raise ApiError(
                429, f"You have {self.max_parallel_per_user} replies being generated; wait for one to finish "
                "(NEXTSTATE_MAX_PARALLEL_PER_USER).", type="requests", code="too_many_parallel_requests",
                headers={"retry-after": "1"},
            )
        admitted = False
        try:
            # A request is in flight until its reply is saved and sent: background work (the
            # judge) waits for quiet, and must not start in the middle of the end-of-turn save.
            with self.activity.request():
                async for event in self._run(prep):
                    admitted = admitted or isinstance(event, Admitted)
                    yield event
        except ApiError as exc:
            if admitted:
                self._failed(prep, exc)
                log.warning("reply %s of %s failed: %s", prep.id, prep.key.user, exc.message)
            raise
        except Exception as exc:
            if not admitted:
                raise
            # a bug, not an engine failure: the client gets a 500-type error event, the
            # operator the traceback and a 'failed' record
            error = server_error()
            self._failed(prep, error)
            log.exception("reply %s of %s failed", prep.id, prep.key.user)
            raise error from exc
        finally:
            await self.slots.give_back(slot)

    def _failed(self, prep: PreparedTurn, exc: ApiError) -> None:
        self.metrics.failed.labels(exc.code or exc.type).inc()
        self.records.write(
            "failed",
            {"id": prep.id, "user": prep.key.user, "session_id": prep.plan.session_id, "turn_type": prep.plan.turn_type,
             "status": exc.status, "code": exc.code, "message": exc.message[:500]},
            version=prep.policy.version if prep.policy else 0,
        )

    async def _run(self, prep: PreparedTurn) -> AsyncIterator[Admitted | StillWorking | Delta | Finished]:
        request = prep.request
        decoder = Decoder(
            self.renderer.tokenizer,
            stop_token_ids=prep.sampling.stop_token_ids,
            stop_strings=request.stop,
            parse_tools=request.parse_tools,
            parallel_calls=request.parallel_tool_calls,
            prefill=prep.prompt.prefill,
            token_text=self.renderer.token_text if request.top_logprobs is not None else None,
        )
        response_ids: list[int] = []
        sampled_logprobs: list[float] = []
        tokens: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        pump = asyncio.create_task(self._pump(prep, tokens), name=f"generate-{prep.id}")
        self.metrics.in_flight.inc()
        held: Any = None  # taken from the queue behind a run of tokens, handled next
        cached: int | None = None
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif not tokens.empty():
                    item = tokens.get_nowait()
                else:
                    # A timer, not asyncio.wait_for: that costs a task per wait, i.e. per chunk.
                    # A marker that fires as a token arrives only adds one harmless keep-alive.
                    quiet = loop.call_later(self.keepalive_s, tokens.put_nowait, _QUIET)
                    try:
                        item = await tokens.get()
                    finally:
                        quiet.cancel()
                if item is _QUIET:
                    yield StillWorking()
                    continue
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise (engine_error(item) if isinstance(item, EngineError) else item) from item
                if isinstance(item, Admitted):
                    prep.policy = item.policy
                    yield item
                    continue
                if not response_ids:
                    self.metrics.ttft.observe(time.monotonic() - prep.started)
                delta = Delta()
                # Tokens that are already waiting go out together, as one chunk: when the
                # engine outpaces the client, one write per token is what costs most.
                while True:
                    if item.cached_prompt_tokens is not None:  # on the first token, or (vLLM) the last
                        cached = item.cached_prompt_tokens
                    response_ids.append(item.token_id)
                    sampled_logprobs.append(item.logprob)
                    delta.extend(decoder.push(item))
                    if decoder.stopped or tokens.empty():
                        break
                    item = tokens.get_nowait()
                    if not _is_token(item):
                        held = item
                        break
                if delta.content or delta.tool_calls:
                    yield delta
                if decoder.stopped:
                    break
        finally:
            pump.cancel()  # stop generating (the client left, or a stop was reached)
            self.metrics.in_flight.dec()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        tail = decoder.flush()
        done = decoder.finished(len(prep.prompt.ids), len(response_ids), cached)
        if request.forced_tool_call and not done.tool_calls:
            raise ApiError(
                400,
                f"The model did not complete the tool call it was made to write within {prep.sampling.max_new_tokens} "
                f"tokens (finish reason '{done.finish_reason}'). Raise max_tokens, or let it answer without a forced call.",
                param="max_tokens" if done.finish_reason == "length" else "tool_choice",
                code="tool_call_incomplete",
            )
        if tail:
            yield tail
        sampled_logprobs, masked = await self._unmasked(prep, response_ids, sampled_logprobs)
        self._commit(prep, done, response_ids, sampled_logprobs, masked)
        await self.sessions.save()  # the turn, and the next state it confirmed, survive a crash now
        await self.limiter.spend(prep.key, done.prompt_tokens + done.completion_tokens)
        yield done

    async def _pump(self, prep: PreparedTurn, tokens: asyncio.Queue) -> None:
        """Engine tokens into `tokens`, with the admission marker first and `_END` last.

        The version is looked up here, right before the engine, not in `prepare`: the route
        awaits between the two, and a swap in that gap unloads the version current then (the
        learner publishes the new one before it unloads the old, so the one current now is
        loaded). The admission marker carries it; nothing has been sent before it."""
        policy = self.policies.current(prep.key.user)
        stream = self.engine.generate(
            prep.prompt.ids, prep.sampling, policy.adapter, on_admit=lambda: tokens.put_nowait(Admitted(policy))
        )
        try:
            first = True
            async for token in stream:
                tokens.put_nowait(token)
                if first:
                    # When the engine sends a burst, the stream yields it without waiting and
                    # the decode loop would only see the first token after the last one.
                    first = False
                    await asyncio.sleep(0)
            tokens.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the decode loop, which raises it
            tokens.put_nowait(exc)
        finally:
            await stream.aclose()

    async def complete(self, prep: PreparedTurn) -> Finished:
        events = self.run(prep)
        try:
            async for event in events:
                if isinstance(event, Finished):
                    return event
        finally:
            await events.aclose()
        raise AssertionError("the decode loop ended without a finished reply")

    async def _unmasked(self, prep: PreparedTurn, response_ids: list[int], logprobs: list[float]) -> tuple[list[float], bool]:
        """A constrained main turn's logprobs as the model gives them, without the grammar mask.

        An engine that reports logprobs after the mask (SGLang: `masked_constrained_logprobs`)
        gave a forced tool call's tokens logprobs near 0 where the model's own are -6 to -9; the
        learner computes the model's own, so that ratio would train on the grammar. The reply is
        scored again (one prefill of the reply, its prompt cached) before it is kept. Returns the
        logprobs and whether they are still masked (scoring failed: the turn is never trained)."""
        if (prep.sampling.json_schema is None or not self.engine.info.masked_constrained_logprobs
                or not response_ids or prep.plan.turn_type != "main"):
            return logprobs, False
        try:
            scored = await self.engine.score(prep.prompt.ids + response_ids, len(prep.prompt.ids),
                                             adapter=prep.policy.adapter if prep.policy else None)
        except EngineError as exc:
            log.warning("reply %s: could not score its constrained tokens again (%s); it will not be trained", prep.id, exc)
            return logprobs, True
        return scored, False

    def _commit(self, prep: PreparedTurn, done: Finished, response_ids: list[int], logprobs: list[float],
                logprobs_masked: bool = False) -> None:
        """Record the request and, for a main turn, hand its tokens to the session."""
        plan, message, request = prep.plan, done.message(), prep.request
        assert prep.policy is not None, "committed before the engine admitted it"
        self.metrics.prompt_tokens.inc(done.prompt_tokens)
        self.metrics.prompt_tokens_cached.inc(done.cached_tokens or 0)
        self.metrics.completion_tokens.inc(done.completion_tokens)
        self.metrics.latency.observe(time.monotonic() - prep.started)
        record: dict[str, Any] = {
            "id": prep.id,
            "user": prep.key.user,
            "session_id": plan.session_id,
            "turn_type": plan.turn_type,
            "session_match": plan.match,
            "turn_index": plan.turn_index,
            "policy_version": prep.policy.version,
            "adapter": prep.policy.adapter,
            "messages": request.messages,
            "tools": request.tools,
            "tool_choice": request.tool_choice,
            "response": message,
            "finish_reason": done.finish_reason,
            "usage": done.usage,
            "latency_s": round(time.monotonic() - prep.started, 4),
        }
        if plan.turn_type == "main" and plan.session is not None:
            self.warmup.served(prep.key.user, prep.sampling.cache_salt or "")
            # the next turn's prompt holds this reply as sampled: the engine's kept prefix and the
            # learner's shared rows run on through it (modelio/prompt_encoder.py `remember`)
            self.renderer.remember_reply(prep.key.user, prep.prompt.ids, response_ids)
            turn = Turn(
                session_id=plan.session.id,
                user=prep.key.user,
                turn_index=plan.turn_index or 0,
                messages=request.messages,
                tools=request.tools,
                tool_choice=request.tool_choice,
                prompt_ids=prep.prompt.ids,
                response_ids=response_ids,
                response_logprobs=logprobs,
                logprob_temperature=1.0 if self.engine.info.raw_logprobs else prep.sampling.logprob_temperature,
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
                track="outcome" if request.hints.outcome_expected else "personal",
                agent=request.hints.agent,
                response_id=prep.id,
                logprobs_masked=logprobs_masked,
            )
            turn = self.sessions.commit_main(plan, turn, message)
            record.update(
                session_id=turn.session_id, turn_index=turn.turn_index,
                prompt_ids=prep.prompt.ids, response_ids=response_ids, response_logprobs=logprobs,
            )
        else:
            self.sessions.finish_side(plan)
        self.records.write("request", record, version=prep.policy.version)
        self.metrics.sessions_open.set(len(self.sessions))
