"""Per-key limits on requests and tokens per minute, answered the way OpenAI answers them.

A key may carry a requests-per-minute and a tokens-per-minute limit (`nextstate keys create
--rpm N --tpm N`). The moving windows are the `limits` library's, in memory. A request over
either limit is a 429 with `Retry-After`; every answer to a limited key carries OpenAI's (and
LiteLLM's) `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers, so a client can pace
itself. Tokens are checked against the prompt before generating and counted in full (prompt
and completion) once the reply is done. The windows are this process's, or (several serving
processes on one PostgreSQL) shared by all of them: core/stores/rate_windows.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nextstate.proxy.errors import ApiError
from nextstate.core.stores.keys import ApiKey
from nextstate.core.stores.rate_windows import MemoryWindows, Window, Windows


@dataclass
class Quota:
    """Where a key stands after a check: the headers to send with its answer."""

    headers: dict[str, str]


def _headers(kind: str, limit: int, window: Window) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(window.remaining),
        f"x-ratelimit-reset-{kind}": f"{window.reset_s:.0f}s",
    }


class RateLimiter:
    def __init__(self, windows: Windows | None = None) -> None:
        self.windows = windows or MemoryWindows()

    async def admit(self, key: ApiKey, prompt_tokens: int, reply_tokens: int = 0) -> Quota:
        """Count one request; refuse it (429) if the key is over either limit. Its tokens are
        its prompt and the most its reply may take (`reply_tokens`, its max_tokens): a request
        larger than the key's whole per-minute budget is refused outright, not served once."""
        headers: dict[str, str] = {}
        if key.rpm:
            window = await self.windows.hit(key.id, "requests", key.rpm)
            headers.update(_headers("requests", key.rpm, window))
            if not window.allowed:
                raise self._refusal(key, "requests", key.rpm, headers)
        if key.tpm:
            requested = max(1, prompt_tokens + reply_tokens)
            window = await self.windows.peek(key.id, "tokens", key.tpm, cost=requested)
            headers.update(_headers("tokens", key.tpm, window))
            if requested > key.tpm:
                raise ApiError(
                    429, f"Request too large for key {key.id}: {prompt_tokens} prompt tokens and up to {reply_tokens} "
                    f"in the reply ({requested}) exceed its limit of {key.tpm} tokens per minute. Send less, or a "
                    "smaller max_tokens.", type="tokens", code="rate_limit_exceeded", headers=headers,
                )
            if not window.allowed:
                raise self._refusal(key, "tokens", key.tpm, headers)
        return Quota(headers)

    async def spend(self, key: ApiKey, tokens: int) -> None:
        """Count a finished reply's tokens (prompt and completion) against the key."""
        if key.tpm and tokens > 0:
            # a reply may overshoot what is left: the window takes what fits, the next request waits
            window = await self.windows.peek(key.id, "tokens", key.tpm)
            if window.remaining > 0:
                await self.windows.hit(key.id, "tokens", key.tpm, cost=min(tokens, window.remaining))

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
