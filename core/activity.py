"""Whether users are being served right now, so background work can wait for a quiet moment.

Judging shares the CPU (and, in-process, the model) with serving. A personal agent's traffic
comes in bursts with think time between turns, so background work that waits — briefly, and
never indefinitely — for no request to be in flight costs users almost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class Activity:
    def __init__(self) -> None:
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self._serving += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._idle.set()

    async def quiet(self, max_wait_s: float) -> bool:
        """Wait until no request is in flight, or `max_wait_s` passed; True if it went quiet."""
        if self._serving == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max_wait_s)
        except asyncio.TimeoutError:
            return False
        return True
