"""The engine contract shared by every implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """The engine could not do what was asked; the proxy maps it to a 5xx in OpenAI's shape."""

    http_status = 500


class EngineUnavailable(EngineError):
    """The engine cannot be reached (not started yet, restarting): 503, try again."""

    http_status = 503


class EngineTimeout(EngineError):
    """The engine did not answer in time: 504."""

    http_status = 504


class EngineRejected(EngineError):
    """The engine refused the request as invalid (e.g. too long for its context): 400."""

    http_status = 400


class EngineBadGateway(EngineError):
    """The engine answered with an error or something unreadable: 502."""

    http_status = 502


class UnknownAdapterError(EngineError):
    """A request named an adapter the engine has not loaded.

    Raised instead of silently falling back to the base model, which would serve (and later
    train on) the wrong policy without anyone noticing.
    """


def check_request(loaded: Iterable[str], adapter: str | None, input_ids: list[int], score_start: int | None = None) -> None:
    """The argument checks every engine makes before doing any work."""
    if not input_ids:
        raise EngineError("a request needs at least one input token")
    if score_start is not None and not 1 <= score_start <= len(input_ids):
        raise EngineError(f"score start must be in [1, {len(input_ids)}], got {score_start}")
    if adapter is not None and adapter not in loaded:
        raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    # Constrain the sampled text to this JSON schema (JSON text), then end of turn: a forced
    # tool call. The embedded engine reports the model's own logprobs, unmasked (what the
    # learner sees); SGLang reports them after the mask (EngineInfo.masked_constrained_logprobs),
    # and the proxy scores such a reply again (proxy/turns.py).
    json_schema: str | None = None
    # Prefix caching stays within one salt: a request reuses the cached keys and values of an
    # earlier prompt only if both carry the same salt. The proxy salts every request with its
    # user, so a cache hit (its `cached_tokens`, its first-token time) can never tell one user
    # that another sent the same text. None is a partition of its own (the judge's calls).
    cache_salt: str | None = None

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose logprobs are reported.

        Sampling logprobs are taken under the tempered distribution the token was drawn from,
        so they can serve as PPO's old logprobs. Greedy decoding has no tempered distribution,
        so it reports the model's own (temperature 1).
        """
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: Literal["stop", "length"] | None = None
    # On a generation's first token (vLLM: its last, where it tells it): how many prompt tokens
    # were not computed again because the engine had their keys and values cached (OpenAI's
    # usage.prompt_tokens_details).
    cached_prompt_tokens: int | None = None


@dataclass
class EngineInfo:
    model_name: str
    max_context: int
    device: str
    dtype: str
    vocab_size: int = 0
    # True: every logprob the engine reports, sampled or scored, is at temperature 1 whatever
    # the sampling temperature (SGLang: see engine/sglang.py). False: at the sampling temperature.
    raw_logprobs: bool = False
    # True: under a JSON-schema constraint the sampled logprobs it reports are taken after the
    # grammar mask, renormalised over the allowed tokens (SGLang), not the model's own; the
    # proxy scores such a reply again without the constraint before it is kept for training.
    masked_constrained_logprobs: bool = False


class Engine(Protocol):
    info: EngineInfo

    def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None = None,
        background: bool = False,
        on_admit: Callable[[], None] | None = None,
    ) -> AsyncIterator[GeneratedToken]:
        """Stream sampled tokens; the last one carries the finish reason.

        Closing the iterator early cancels the generation (client went away, stop string hit).
        `background` work (the in-process judge) yields to user requests. `on_admit` is called
        once the engine has accepted the request (queued, or its server answered), before the
        first token: a long prompt can take a minute to prefill, and the client should hear
        that its request is being served.
        """
        ...

    async def score(
        self,
        input_ids: list[int],
        start: int,
        adapter: str | None = None,
        temperature: float = 1.0,
        background: bool = False,
    ) -> list[float]:
        """Log-probability of each of `input_ids[start:]` given everything before it."""
        ...

    async def load_adapter(self, name: str, path: str) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    @property
    def adapters(self) -> list[str]:
        """The adapters loaded now, by name: what requests may name."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class AdapterServer(Protocol):
    """What an engine whose server outlives nextstate and serves several processes at once
    (SGLang, vLLM) does besides: the learner that published a version unloads it from the
    server, so every other process only stops sending it; and a server that outlived a crashed
    nextstate still holds the versions it loaded. Checked once, when the learner or follower
    is built (`isinstance`): an in-process engine frees an adapter itself."""

    async def release_adapter(self, name: str) -> None:
        """Stop sending `name`, leaving it loaded on the server for its other users."""
        ...

    async def unload_leftovers(self, root: Path, keep: set[str]) -> list[str]:
        """Unload what the server holds from under `root` that this client did not load."""
        ...


@runtime_checkable
class SharedCores(Protocol):
    """What an engine on this process's own cores (the embedded one) does besides: its
    background work holds back while `held()` (the learner computing beside it), as it does
    beside a person's request. Checked once, when the serving process is wired (`isinstance`)."""

    def hold_background(self, held: Callable[[], bool]) -> None: ...
