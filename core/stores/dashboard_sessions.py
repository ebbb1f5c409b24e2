"""Who is signed in to `/dashboard`: random session tokens, short-lived, and a throttle on sign-in.

The page once kept the admin key itself in its cookie, for seven days: a copied cookie was the
key, with every admin right over the API, until revoked. A session token opens the dashboard
only, ends after `SESSION_S`, and ends at once when its key is revoked or its user forgotten
(the key is looked up on every use). Sign-in attempts are limited per client address, so a
stolen-cookie-free guessing run gets `SIGN_IN_PER_MINUTE` tries a minute.

Tokens are kept in memory, or with a shared database (NEXTSTATE_DATABASE_URL) in it — a
dashboard opened through one serving process stays open when the load balancer sends the next
page to another — as their SHA-256 only, so the table holds nothing a cookie could be made of;
the sign-in throttle then counts on the shared rate windows too.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from nextstate.core.stores.base import Store
from nextstate.core.stores.rate_windows import MemoryWindows, Windows

SESSION_S = 8 * 3600.0
SIGN_IN_PER_MINUTE = 10

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dashboard_sessions (
    token_hash TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    until {float} NOT NULL
)
"""


class _SignIns(Store):
    """The sessions in PostgreSQL, where every serving process finds one another opened."""

    SCHEMA = _SCHEMA

    def find(self, token_hash: str) -> tuple[str, float] | None:
        return self._one("SELECT key_id, until FROM dashboard_sessions WHERE token_hash = ?", (token_hash,))

    def add(self, token_hash: str, key_id: str, now: float, until: float) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM dashboard_sessions WHERE until <= ?", (now,))  # expired ones go
            db.execute("INSERT INTO dashboard_sessions (token_hash, key_id, until) VALUES (?, ?, ?)",
                       (token_hash, key_id, until))


class DashboardSessions:
    def __init__(self, lifetime_s: float = SESSION_S, clock: Callable[[], float] = time.time,
                 database_url: str | None = None, attempts: Windows | None = None) -> None:
        """`attempts`: the rate windows the sign-in throttle counts on (the server's own, shared
        with a database); this process's memory if not given."""
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._db = _SignIns(Path("unused"), database_url) if database_url else None
        self._tokens: dict[str, tuple[str, float]] = {}  # token hash → (the admin key's id, when it ends)
        self._attempts = attempts or MemoryWindows()

    async def may_try(self, client: str) -> bool:
        """Count one sign-in attempt from `client`; False once it is over the limit."""
        return (await self._attempts.hit(client, "dashboard-sign-in", SIGN_IN_PER_MINUTE)).allowed

    async def open(self, key_id: str) -> str:
        token = secrets.token_urlsafe(32)
        now = self._clock()
        if self._db is None:
            self._tokens = {t: v for t, v in self._tokens.items() if v[1] > now}  # expired ones go
            self._tokens[_hash(token)] = (key_id, now + self.lifetime_s)
        else:
            await asyncio.to_thread(self._db.add, _hash(token), key_id, now, now + self.lifetime_s)
        return token

    async def key_id(self, token: str) -> str | None:
        """The key a live session was opened with, or None."""
        if not token:
            return None
        if self._db is None:
            found = self._tokens.get(_hash(token))
        else:
            found = await asyncio.to_thread(self._db.find, _hash(token))
        if found is None or found[1] <= self._clock():
            return None
        return found[0]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
