"""Per-key limits on requests and tokens per minute, answered the way OpenAI answers them.

A key may carry a requests-per-minute and a tokens-per-minute limit (`nextstate keys create
--rpm N --tpm N`). The moving windows are the `limits` library's, in memory. A request over
either limit is a 429 with `Retry-After`; every answer to a limited key carries OpenAI's (and
LiteLLM's) `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers, so a client can pace
itself. Tokens are checked against the prompt before generating and counted in full (prompt
and completion) once the reply is done.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from nextstate.proxy.errors import ApiError
from nextstate.proxy.keys import ApiKey


@dataclass
class Quota:
    """Where a key stands after a check: the headers to send with its answer."""

    headers: dict[str, str]


def _reset(seconds: float) -> str:
    return f"{max(0.0, seconds):.0f}s"


class RateLimiter:
    def __init__(self) -> None:
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    async def admit(self, key: ApiKey, prompt_tokens: int, reply_tokens: int = 0) -> Quota:
        """Count one request; refuse it (429) if the key is over either limit. Its tokens are
        its prompt and the most its reply may take (`reply_tokens`, its max_tokens): a request
        larger than the key's whole per-minute budget is refused outright, not served once."""
        headers: dict[str, str] = {}
        if key.rpm:
            item = RateLimitItemPerMinute(key.rpm)
            allowed = await self._limiter.hit(item, "requests", key.id)
            headers.update(await self._headers(item, key.id, "requests"))
            if not allowed:
                raise self._refusal(key, "requests", key.rpm, headers)
        if key.tpm:
            item = RateLimitItemPerMinute(key.tpm)
            requested = max(1, prompt_tokens + reply_tokens)
            headers.update(await self._headers(item, key.id, "tokens"))
            if requested > key.tpm:
                raise ApiError(
                    429, f"Request too large for key {key.id}: {prompt_tokens} prompt tokens and up to {reply_tokens} "
                    f"in the reply ({requested}) exceed its limit of {key.tpm} tokens per minute. Send less, or a "
                    "smaller max_tokens.", type="tokens", code="rate_limit_exceeded", headers=headers,
                )
            allowed = await self._limiter.test(item, "tokens", key.id, cost=requested)
            if not allowed:
                raise self._refusal(key, "tokens", key.tpm, headers)
        return Quota(headers)

    async def spend(self, key: ApiKey, tokens: int) -> None:
        """Count a finished reply's tokens (prompt and completion) against the key."""
        if key.tpm and tokens > 0:
            item = RateLimitItemPerMinute(key.tpm)
            # a reply may overshoot what is left: the window takes what fits, the next request waits
            stats = await self._limiter.get_window_stats(item, "tokens", key.id)
            if stats.remaining > 0:
                await self._limiter.hit(item, "tokens", key.id, cost=min(tokens, stats.remaining))

    async def _headers(self, item: RateLimitItemPerMinute, key_id: str, kind: str) -> dict[str, str]:
        stats = await self._limiter.get_window_stats(item, kind, key_id)
        return {
            f"x-ratelimit-limit-{kind}": str(item.amount),
            f"x-ratelimit-remaining-{kind}": str(max(0, stats.remaining)),
            f"x-ratelimit-reset-{kind}": _reset(stats.reset_time - time.time()),
        }

    @staticmethod
    def _refusal(key: ApiKey, kind: str, limit: int, headers: dict[str, str]) -> ApiError:
        wait = math.ceil(float(headers[f"x-ratelimit-reset-{kind}"].rstrip("s")) or 1)
        return ApiError(
            429,
            f"Rate limit reached for key {key.id}: {limit} {kind} per minute. Try again in {wait}s.",
            type=kind,  # OpenAI's 429s say "requests" or "tokens" here
            code="rate_limit_exceeded",
            headers={**headers, "retry-after": str(wait)},
        )
