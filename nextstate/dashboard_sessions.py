"""Who is signed in to `/dashboard`: random session tokens, short-lived, and a throttle on sign-in.

The page once kept the admin key itself in its cookie, for seven days: a copied cookie was the
key, with every admin right over the API, until revoked. A session token opens the dashboard
only, ends after `SESSION_S`, and ends at once when its key is revoked or its user forgotten
(the key is looked up on every use). Sign-in attempts are limited per client address, so a
stolen-cookie-free guessing run gets `SIGN_IN_PER_MINUTE` tries a minute.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

SESSION_S = 8 * 3600.0
SIGN_IN_PER_MINUTE = 10


class DashboardSessions:
    def __init__(self, lifetime_s: float = SESSION_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._tokens: dict[str, tuple[str, float]] = {}  # token → (the admin key's id, when it ends)
        self._attempts = MovingWindowRateLimiter(MemoryStorage())
        self._per_minute = RateLimitItemPerMinute(SIGN_IN_PER_MINUTE)

    def may_try(self, client: str) -> bool:
        """Count one sign-in attempt from `client`; False once it is over the limit."""
        return self._attempts.hit(self._per_minute, "dashboard-sign-in", client)

    def open(self, key_id: str) -> str:
        now = self._clock()
        self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}  # expired ones go
        token = secrets.token_urlsafe(32)
        self._tokens[token] = (key_id, now + self.lifetime_s)
        return token

    def key_id(self, token: str) -> str | None:
        """The key a live session was opened with, or None."""
        found = self._tokens.get(token)
        if found is None or found[1] <= self._clock():
            self._tokens.pop(token, None)
            return None
        return found[0]
