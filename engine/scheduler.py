"""Which of the embedded engine's jobs run in each round of its worker loop.

Users come first. A user request is admitted while fewer than `max_active` user requests
decode, whatever background work (the in-process judge) is waiting, and background work runs
only once users have been quiet for `BACKGROUND_IDLE_GAP_S`, one step at a time (a prompt in
`BACKGROUND_IDLE_CHUNK`-token steps), the longest-waiting job first; while users keep the engine busy, one background step still runs
every `BACKGROUND_MAX_WAIT_S` (a prompt in `BACKGROUND_CHUNK`-token steps), so judging never starves;
and so it does while `held()`, the learner computing beside serving (core/activity.py `learning`). Calls that must wait for an adapter's
last user (unloads) are held here until no queued or running job still uses it.

Pure bookkeeping: no model, no threads. The worker loop in `engine.local` owns the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nextstate.engine.base import SamplingParams

# Background work runs only while no user request is decoding; while users keep it busy, one
# background step runs per this many seconds, so it never starves.
BACKGROUND_MAX_WAIT_S = 1.0
# Background prompts are fed this many tokens per step beside a user's request, so a long
# judge prompt never holds the model for more than a short step while a user request waits...
BACKGROUND_CHUNK = 32
# ... and this many while no user request is running: a prompt read in 32-token steps goes at a
# fraction of the pace of larger ones (docs/benchmark-log.md, "The turn after a version"), and a
# request that arrives meanwhile waits for one step at most.
BACKGROUND_IDLE_CHUNK = 256
# ... and starts only after no user request has decoded for this long.
BACKGROUND_IDLE_GAP_S = 0.1


@dataclass(eq=False)
class Job:
    """One generation, or one scoring pass (`score_from` set), and its decoding state."""

    input_ids: list[int]
    sampling: SamplingParams
    adapter: str | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    background: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    cache: Any = None
    last_token: int | None = None
    fed: int = 0  # prompt tokens already through the model
    cached: int = 0  # ... of which were taken from the prefix cache
    # A scoring job (the judge's teacher pass): logprobs of input_ids[score_from:], no sampling.
    score_from: int | None = None
    score_temperature: float = 1.0
    scores: list[float] = field(default_factory=list)
    last_step: float = field(default_factory=time.monotonic)
    constraint: Any = None  # a JsonConstraint when sampling.json_schema is set
    output_ids: list[int] = field(default_factory=list)  # sampled so far
    batch: Any = None  # the DecodeBatch it decodes in, once its prompt is through
    # background prompt tokens fed in its next step (the scheduler sets it each round)
    chunk: int = BACKGROUND_CHUNK

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens fed per step: all at once for users, in steps in the background."""
        return self.chunk if self.background else len(self.input_ids)

    def deliver(self, item: Any) -> None:
        """Hand a token, a result or an error to the waiting coroutine (from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)


@dataclass(eq=False)
class Call:
    """A function to run on the worker thread between steps (adapter loads and unloads)."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    # Adapter unloads wait until no queued or running generation still uses the adapter.
    waits_for_adapter: str | None = None

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
            self.loop.call_soon_threadsafe(settle)


class Scheduler:
    def __init__(self, max_active: int, held: Callable[[], bool] = lambda: False) -> None:
        self.max_active = max_active
        # True while something else takes the cores first (the learner's update): background
        # work then runs as beside a user's request, a short step per BACKGROUND_MAX_WAIT_S
        self.held = held
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []
        self.deferred: list[Call] = []
        self._last_background_step = time.monotonic()
        self._last_user_step = 0.0

    @property
    def idle(self) -> bool:
        return not (self.active or self.waiting or self.deferred)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def finish(self, job: Job) -> None:
        """A job is done (finished, failed or cancelled): free its slot and its cache."""
        if job in self.active:
            self.active.remove(job)
        job.cache = None

    def admit(self) -> None:
        """Fill free decoding slots. Background work never takes a user's slot: a user
        request is admitted while fewer than max_active user requests decode."""
        users = sum(1 for job in self.active if not job.background)
        for job in list(self.waiting):
            if job.background:
                admit = len(self.active) < self.max_active
            else:
                admit = users < self.max_active
                users += admit
            if admit:
                self.waiting.remove(job)
                self.active.append(job)

    def runnable(self, now: float | None = None) -> list[Job]:
        """This round's jobs: the user requests, plus one background job if background work
        has waited BACKGROUND_MAX_WAIT_S; with no user request, one background job once users
        have been quiet for BACKGROUND_IDLE_GAP_S."""
        now = time.monotonic() if now is None else now
        users = [job for job in self.active if not job.background]
        background = [job for job in self.active if job.background]
        if not users:
            # A client usually sends its next request right after a reply (an agent's tool
            # call, say): background work starts only once users have been quiet for a moment,
            # then runs one step at a time, so a user request that arrives meanwhile waits for
            # at most one short step.
            if not background or now - self._last_user_step < BACKGROUND_IDLE_GAP_S:
                return []
            held = self.held()
            if held and now - self._last_background_step < BACKGROUND_MAX_WAIT_S:
                return []
            self._last_background_step = now
            job = min(background, key=lambda job: job.last_step)
            job.chunk = BACKGROUND_CHUNK if held else BACKGROUND_IDLE_CHUNK
            return [job]
        self._last_user_step = now
        if background and now - self._last_background_step >= BACKGROUND_MAX_WAIT_S:
            self._last_background_step = now
            job = min(background, key=lambda job: job.last_step)
            job.chunk = BACKGROUND_CHUNK
            return users + [job]
        return users

    def defer(self, call: Call) -> None:
        self.deferred.append(call)

    def due_calls(self) -> list[Call]:
        """Deferred calls whose adapter no live job uses any more (removed from the queue)."""
        if not self.deferred:
            return []
        in_use = {job.adapter for job in (*self.active, *self.waiting) if not job.cancelled.is_set()}
        due = [call for call in self.deferred if call.waits_for_adapter not in in_use]
        self.deferred = [call for call in self.deferred if call.waits_for_adapter in in_use]
        return due

    def drain(self) -> tuple[list[Job], list[Call]]:
        """Everything still pending, removed (the engine is shutting down)."""
        jobs, calls = [*self.active, *self.waiting], self.deferred
        self.active, self.waiting, self.deferred = [], deque(), []
        return jobs, calls
