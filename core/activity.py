"""Whether users are being served right now, so background work can wait for a quiet moment.

Judging shares the CPU (and, in-process, the model) with serving. A personal agent's traffic
comes in bursts with think time between turns, so background work that waits — briefly, and
never indefinitely — for no request to be in flight costs users almost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

# Work in a thread that makes way for requests (`make_way`) waits at most this long for one to
# end, then runs this long before it waits again: an agent that never pauses still gets its
# update, at about half the pace.
MAKE_WAY_S = 30.0


class Activity:
    def __init__(self) -> None:
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._idle_now = threading.Event()  # the same, for threads
        self._idle_now.set()
        self._ran_since = 0.0  # when `make_way` last stopped waiting without the quiet
        self._learning = 0  # updates (and their reads ahead) computing now

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self._serving += 1
        self._idle.clear()
        self._idle_now.clear()
        try:
            yield
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._idle.set()
                self._idle_now.set()

    @contextlib.contextmanager
    def learning(self) -> Iterator[None]:
        """The learner computes (an update, or what it reads ahead for one): the engine's
        background work (the judge's calls, a version's warm-up reads) holds back meanwhile
        (`learning_now`), as it does beside a person's request. On two cores a judge's votes
        beside an update each ran at half pace; the version a person waits for comes first.
        Entered and left on the event loop."""
        self._learning += 1
        try:
            yield
        finally:
            self._learning -= 1

    def learning_now(self) -> bool:
        return self._learning > 0

    def make_way(self) -> None:
        """Block the calling thread while a request is served (the learner calls it between its
        model's layers): on a CPU a training pass beside a reply takes the cores the reply
        decodes on. At most MAKE_WAY_S at a time, then MAKE_WAY_S of running without waiting."""
        if self._idle_now.is_set() or time.monotonic() - self._ran_since < MAKE_WAY_S:
            return
        if not self._idle_now.wait(MAKE_WAY_S):
            self._ran_since = time.monotonic()

    async def quiet(self, max_wait_s: float) -> bool:
        """Wait until no request is in flight, or `max_wait_s` passed; True if it went quiet."""
        if self._serving == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max_wait_s)
        except asyncio.TimeoutError:
            return False
        return True
