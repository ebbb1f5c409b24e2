"""Writes that must not be lost: retried until the disk takes them, held in memory meanwhile.

A full or read-only disk, or a database that restarts, must cost no transition and no sample. `Durable.write` runs a blocking
write in a thread and, when it fails with an OS or database error, keeps it and tries again
with growing pauses (up to `MAX_BACKOFF_S`) until it succeeds; the caller awaits the result and
simply waits longer. At most `limit` writes wait at once: past that, a new one fails at once,
with a clear log line, rather than growing memory without bound. One log line marks the start
of an outage and one its end.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from nextstate.core.stores.database import is_unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_BACKOFF_S = 5.0
# SQLite's words for a disk that cannot take the write now (full, read-only, busy, failing)
_TRANSIENT = ("disk", "full", "readonly", "read-only", "locked", "busy", "i/o")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, OSError) or is_unavailable(exc):  # a full disk, or a database restarting
        return True
    return isinstance(exc, sqlite3.OperationalError) and any(word in str(exc).lower() for word in _TRANSIENT)


class StorageUnavailable(RuntimeError):
    """Too many writes already wait for the disk; this one was not kept."""


class Durable:
    def __init__(self, what: str, limit: int = 10_000, first_backoff_s: float = 0.25) -> None:
        self.what = what
        self.limit = limit
        self.first_backoff_s = first_backoff_s
        self.waiting = 0

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        backoff = self.first_backoff_s
        failed = False
        while True:
            try:
                result = await asyncio.to_thread(fn, *args)
            except Exception as exc:
                if not _transient(exc):
                    raise
                if not failed:
                    if self.waiting >= self.limit:
                        log.error("%s: %d writes already wait for the disk; one more is lost (%s)", self.what, self.waiting, exc)
                        raise StorageUnavailable(str(exc)) from exc
                    failed = True
                    self.waiting += 1
                    if self.waiting == 1:
                        log.error("%s cannot be written (%s); kept in memory and retried until it can", self.what, exc)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            if failed:
                self.waiting -= 1
                if self.waiting == 0:
                    log.warning("%s: the disk takes writes again; nothing was lost", self.what)
            return result
