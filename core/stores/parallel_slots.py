"""How many replies each user has being generated, against NEXTSTATE_MAX_PARALLEL_PER_USER: in
this process, or counted across every serving process through PostgreSQL.

One process counts in a dict. Several must count together, or a user gets the cap from each
process: each reply in flight is then a row (`running`), taken in one statement if the user has fewer
than the cap, and deleted when the reply ends. A process that dies cannot delete its rows, so each is a lease its process
renews while the reply runs (`RENEW_S`); a dead process's replies stop counting within `LEASE_S`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path
from typing import Protocol

from nextstate.core.stores.base import Store
from nextstate.core.tasks import Periodic

log = logging.getLogger(__name__)

LEASE_S = 60.0
RENEW_S = 15.0
_PRUNE_EVERY = 1000  # slots taken between deletions of the expired ones


class Slots(Protocol):
    async def take(self, user: str, cap: int) -> str | None:
        """A slot for one reply of `user`'s (its token), or None: `cap` are taken."""

    async def give_back(self, token: str) -> None: ...


class LocalSlots:
    def __init__(self) -> None:
        self._running: dict[str, int] = {}
        self._owner: dict[str, str] = {}

    async def take(self, user: str, cap: int) -> str | None:
        if self._running.get(user, 0) >= cap:
            return None
        self._running[user] = self._running.get(user, 0) + 1
        token = secrets.token_hex(8)
        self._owner[token] = user
        return token

    async def give_back(self, token: str) -> None:
        user = self._owner.pop(token)
        self._running[user] -= 1
        if not self._running[user]:
            del self._running[user]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS running (
    token TEXT PRIMARY KEY,
    "user" TEXT NOT NULL,
    worker TEXT NOT NULL,
    until {float} NOT NULL
);
CREATE INDEX IF NOT EXISTS running_user ON running ("user", until)
"""


class SharedSlots(Store):
    """Replies in flight as leased rows in PostgreSQL (its data-modifying WITH takes a slot in
    one statement; one process alone counts in memory, `LocalSlots`)."""

    SCHEMA = _SCHEMA
    PRAGMAS = ("busy_timeout=5000",)

    def __init__(self, path: Path, database_url: str | None, worker: str) -> None:
        super().__init__(path, database_url)
        # this run of the process: one restarted on the same host and port must not renew the
        # leases its dead predecessor left
        self.worker = f"{worker}/{secrets.token_hex(4)}"
        self._renewer = Periodic(RENEW_S, "renew this process's parallel-reply slots", self._renew)
        self._takes = 0

    async def take(self, user: str, cap: int) -> str | None:
        self._renewer.start()
        return await asyncio.to_thread(self._take, user, cap)

    def _take(self, user: str, cap: int) -> str | None:
        """One statement on the request path: the slot is taken if fewer than `cap` others are
        live. Two takers of one user at the same instant may both see the other not yet there
        and pass at `cap` - 1 (a cap exceeded by one, for the length of a reply); the alternative,
        a per-user lock, cost four more round trips on every request."""
        now = time.time()
        token = secrets.token_hex(12)
        with self._lock:
            (taken,) = self._db.execute(
                'WITH taken AS (INSERT INTO running (token, "user", worker, until) '
                'SELECT ?, ?, ?, ? WHERE (SELECT COUNT(*) FROM running WHERE "user" = ? AND until > ?) < ? RETURNING 1) '
                "SELECT COUNT(*) FROM taken",
                (token, user, self.worker, now + LEASE_S, user, now, cap),
            ).fetchone()
            self._takes += 1
            if self._takes % _PRUNE_EVERY == 0:
                self._db.execute("DELETE FROM running WHERE until <= ?", (now,))  # dead processes' slots
        return token if taken else None

    async def give_back(self, token: str) -> None:
        try:
            await asyncio.to_thread(self._execute, "DELETE FROM running WHERE token = ?", (token,))
        except Exception:  # noqa: BLE001 - the lease runs out instead
            log.exception("could not give back a parallel-reply slot; it frees within %.0f s", LEASE_S)

    def _renew(self) -> None:
        self._execute("UPDATE running SET until = ? WHERE worker = ?", (time.time() + LEASE_S, self.worker))

    async def aclose(self) -> None:
        await self._renewer.stop()
        await asyncio.to_thread(self._execute, "DELETE FROM running WHERE worker = ?", (self.worker,))
        self.close()
