"""The per-minute windows behind the rate limits: in this process, or shared by every serving
process through PostgreSQL.

One process keeps `limits`' moving window in memory (exact, and nothing to run beside it).
Several processes must count each key together, or a key limited to N requests a minute gets N
from each. Measured (bench/shared_counters.py, BENCHMARKS.md "Past one machine"): a counter per
key and minute in PostgreSQL, updated by one UPSERT, took 0.14 ms a check (1.3 ms with 16 at
once) against 0.34 ms (2.3 ms) for `limits`' moving window or sliding counter on Redis — and a
deployment that shares state has PostgreSQL already, so the shared windows live there and no
Redis is needed. They are sliding-window counters (as `limits`' own on Redis): the count of the
current minute plus the previous minute's weighted by the part of it still inside the window,
an estimate that never lets through more than the limit over any whole minute boundary.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from nextstate.core.stores.base import Store


@dataclass(frozen=True)
class Window:
    """Where a key stands in one window after a check."""

    allowed: bool
    remaining: int
    reset_s: float  # until room frees up


class Windows(Protocol):
    async def hit(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        """Count `cost` against the window if it fits (allowed), else count nothing."""

    async def peek(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        """Whether `cost` would fit now; counts nothing."""


class MemoryWindows:
    """`limits`' moving windows, in this process."""

    def __init__(self) -> None:
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    async def hit(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        item = RateLimitItemPerMinute(limit)
        allowed = await self._limiter.hit(item, kind, key, cost=cost)
        return await self._stats(item, key, kind, allowed)

    async def peek(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        item = RateLimitItemPerMinute(limit)
        return await self._stats(item, key, kind, await self._limiter.test(item, kind, key, cost=cost))

    async def _stats(self, item: RateLimitItemPerMinute, key: str, kind: str, allowed: bool) -> Window:
        stats = await self._limiter.get_window_stats(item, kind, key)
        return Window(allowed, max(0, stats.remaining), max(0.0, stats.reset_time - time.time()))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS rate_counts (
    key TEXT NOT NULL,
    minute BIGINT NOT NULL,
    count BIGINT NOT NULL,
    PRIMARY KEY (key, minute)
)
"""
_PRUNE_EVERY = 1000  # checks between deletions of windows that ended


class SharedWindows(Store):
    """Sliding-window counters in PostgreSQL (or a SQLite file, for one process's tests)."""

    SCHEMA = _SCHEMA

    def __init__(self, path: Path, database_url: str | None = None) -> None:
        super().__init__(path, database_url)
        self._checks = 0

    def _schema(self, database_url: str | None) -> str:
        # UNLOGGED: counters a crash may lose (a minute's worth) are not worth a WAL write each
        return _SCHEMA.replace("CREATE TABLE", "CREATE UNLOGGED TABLE") if database_url else _SCHEMA

    async def hit(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        return await asyncio.to_thread(self._check, f"{kind}:{key}", limit, cost, True)

    async def peek(self, key: str, kind: str, limit: int, cost: int = 1) -> Window:
        return await asyncio.to_thread(self._check, f"{kind}:{key}", limit, cost, False)

    def _check(self, key: str, limit: int, cost: int, count: bool) -> Window:
        now = time.time()
        minute, into = int(now // 60), (now % 60) / 60
        with self._lock:
            rows = dict(self._db.execute(
                "SELECT minute, count FROM rate_counts WHERE key = ? AND minute IN (?, ?)", (key, minute - 1, minute)
            ).fetchall())
            before = rows.get(minute - 1, 0) * (1 - into)  # the previous minute, as much of it as is still in the window
            current = rows.get(minute, 0)
            allowed = current + before + cost <= limit
            if count and allowed:
                # checked again under the row's lock: another process may have counted since the read
                row = self._db.execute(
                    "INSERT INTO rate_counts (key, minute, count) SELECT ?, ?, ? WHERE ? <= ? "
                    "ON CONFLICT (key, minute) DO UPDATE SET count = rate_counts.count + excluded.count "
                    "WHERE rate_counts.count + excluded.count <= ? RETURNING count",
                    (key, minute, cost, cost + before, limit, limit - before),
                ).fetchone()
                allowed = row is not None
                current = row[0] if row is not None else current
            self._checks += 1
            if self._checks % _PRUNE_EVERY == 0:
                self._db.execute("DELETE FROM rate_counts WHERE minute < ?", (minute - 1,))
        remaining = max(0, int(limit - current - before))
        return Window(allowed, remaining, 60 * (1 - into))
