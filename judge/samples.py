"""The sample desk: what every path to a stored sample shares — the judge's verdicts, a
person's ratings, an episode's last step.

Three paths make samples and all three must agree on the same few things, or a rating and a
judgement of one reply could race, a full disk could lose one of them, or the learner could miss
a batch: one lock per reply, one writer that a full disk delays instead of failing, one shape
of sample (a reply scored under a grammar mask never trains), one call that tells the learner,
and one set of background work that a shutdown drains. The judge (judge/service.py), explicit
feedback (judge/feedback.py) and the inbox (judge/inbox.py) each hold this desk and ask the
judge itself only for the judging.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from nextstate.core.durable import Durable
from nextstate.core.stores.samples import SampleStore
from nextstate.core.tasks import BackgroundTasks
from nextstate.core.types import Sample, Turn
from nextstate.judge.advantages import with_outcome

T = TypeVar("T")


class SampleDesk:
    def __init__(self, mode: str, store: SampleStore, on_sample: Callable[[Sample], None] | None = None) -> None:
        self.mode = mode
        self._store = store
        self.on_sample = on_sample
        # a full or read-only disk holds samples here until it takes them again
        self._writes = Durable("the sample store (judged samples)")
        self._turn_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Work off the request path (calibration, judgements, ratings being applied): the inbox
        # and explicit feedback start theirs here too, so one drain waits for all of it.
        self.tasks = BackgroundTasks()

    def spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Background work (a judgement, a rating being applied): drained and cancelled with the judge."""
        return self.tasks.spawn(work)

    def turn_lock(self, response_id: str | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """One judgement at a time per reply: the judge's and a person's rating of it never race."""
        if not response_id:
            return contextlib.nullcontext()
        lock = self._turn_locks.get(response_id)
        if lock is None:
            lock = self._turn_locks[response_id] = asyncio.Lock()
        return lock

    def make(self, turn: Turn, status: str, reason: str, reward: float = 0.0, advantages: list[float] | None = None,
             track: str | None = None, **extra: Any) -> Sample:
        """The sample of `turn`, in the one shape every path stores."""
        n = len(turn.response_ids)
        if turn.logprobs_masked and status != "dropped":
            # π_old would be the grammar's renormalised distribution, the learner's π_θ the
            # model's own: the PPO ratio between them is meaningless (engine/base.py)
            status, reason = "dropped", "logprobs taken under a grammar mask (the reply could not be scored again)"
        accepted = status != "dropped"
        return Sample(
            user=turn.user, session_id=turn.session_id, turn_index=turn.turn_index, policy_version=turn.policy_version,
            adapter=turn.adapter, mode=self.mode, track=track or turn.track, status=status, reason=reason,
            prompt_ids=turn.prompt_ids, response_ids=turn.response_ids, old_logprobs=turn.response_logprobs,
            logprob_temperature=turn.logprob_temperature,
            advantages=advantages if advantages is not None else [0.0] * n,
            loss_mask=[1 if accepted else 0] * n, reward=reward, response_id=turn.response_id, created_at=time.time(),
            **extra,
        )

    async def store(self, sample: Sample, transition_id: int | None = None) -> Sample:
        """Store a sample made outside a judgement (a rating, an episode's last step), closing
        its inbox entry if one is named, and tell the learner."""
        stored = await self._writes.write(self._store.add_sample, sample, transition_id, with_outcome)
        if stored is None:  # only a claimed judgement is ever refused
            raise RuntimeError("the sample store refused an unclaimed sample")
        self.notify(stored)
        return stored

    async def store_judged(self, sample: Sample, transition_id: int | None) -> Sample | None:
        """Store a judgement's sample under this worker's claim on its inbox entry; None when
        the claim ran out and another worker judged it (a shared database). The caller tells
        the learner once it has recorded the judgement."""
        return await self._writes.write(self._store.add_sample, sample, transition_id, with_outcome, True)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """A write to the sample store that a full disk delays instead of losing (core/durable.py)."""
        return await self._writes.write(fn, *args)

    def notify(self, sample: Sample) -> None:
        """A sample was stored or replaced: the learner may have a batch now."""
        if self.on_sample is not None:
            self.on_sample(sample)
