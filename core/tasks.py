"""Background coroutines that must be waited for, not lost: the judge's work off the request path.

asyncio keeps only a weak reference to a task, so a task nobody holds can vanish mid-flight;
and forgetting a user, or stopping the server, must first let what is being done for them land.
One `BackgroundTasks` holds the tasks that several objects start (the judge, its inbox, explicit
feedback), so one `drain` waits for all of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

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
