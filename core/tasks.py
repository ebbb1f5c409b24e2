"""Background coroutines that must be waited for, not lost: the judge's work off the request path;
and `Periodic`, a call repeated while the process lives.

asyncio keeps only a weak reference to a task, so a task nobody holds can vanish mid-flight;
and forgetting a user, or stopping the server, must first let what is being done for them land.
One `BackgroundTasks` holds the tasks that several objects start (the judge, its inbox, explicit
feedback), so one `drain` waits for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every task (also those started meanwhile) is done, or `timeout` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._tasks:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait(set(self._tasks), timeout=remaining)
            if deadline is not None and time.monotonic() >= deadline:
                return

    async def cancel(self) -> None:
        """Cancel what is left and wait for it to unwind."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Periodic:
    """A blocking call (`call(*args)`, on a worker thread) every `interval_s` seconds, from
    `start` to `stop`: the renewal of a lease that says this process lives. A failed round is
    logged and the next one tries again (a lease outlives a few missed renewals)."""

    def __init__(self, interval_s: float, what: str, call: Callable[..., Any], *args: Any) -> None:
        self.interval_s, self.what, self._call, self._args = interval_s, what, call, args
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start once (later calls do nothing), in the running loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.what)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self._call, *self._args)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.warning("could not %s", self.what, exc_info=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
