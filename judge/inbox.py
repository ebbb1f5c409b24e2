"""The judge's inbox: where each (turn, next state) transition is handed over, crash-safely.

The sessions hand over a transition and may forget it once the returned future resolves:
by then it is on disk (`samples.sqlite3`'s inbox), so a crash or restart re-judges it instead of
losing it. From there the inbox decides *whether and when* a transition is judged — after the
judge's start-up check, in a quiet moment, never when its user rated the reply already — and
`judge.service.Judge` decides *how*. Transitions with nothing to judge (no next state, or no
implicit judging) are kept as `unjudged`, so that their turns can still be rated.

Where judging happens: in the serving process that wrote the transition (the default), or in
`nextstate judge` processes of their own (NEXTSTATE_JUDGE_IN_PROCESS=false in the serving ones):
then the serving process only writes the inbox, unclaimed, and each judge process `poll`s it,
claiming a bounded batch at a time, so several judges share the work and none takes it all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from nextstate.core.durable import Durable, StorageUnavailable
from nextstate.core.stores.samples import LEASE_S, SampleStore
from nextstate.core.tasks import Periodic
from nextstate.core.types import Transition, Turn
from nextstate.judge.samples import SampleDesk

log = logging.getLogger(__name__)


# A worker renews its claims this often (a quarter of their lease: one missed renewal is no loss).
RENEW_S = LEASE_S / 4


class InboxJudge(Protocol):
    """What the inbox asks of the judge itself (judge/service.py's `Judge`), and no more: whether
    and when it may judge, and the judging; the rest it shares with every sample's path through
    the desk (judge/samples.py)."""

    implicit: bool  # next states are judged (False: the judge is off, or benched with no fallback)

    async def verdict(self) -> bool:
        """Wait for the start-up check's verdict; False when the server stops first."""

    async def quiet(self) -> None:
        """Wait for a moment when no user's request is being served."""

    async def judge(self, transition_id: int | None, transition: Transition, outcome: float | None) -> Any: ...

    def record_transition(self, transition: Transition) -> None: ...


class JudgeInbox:
    def __init__(self, judge: InboxJudge, desk: SampleDesk, store: SampleStore, here: bool = True) -> None:
        self.judge = judge
        self.desk = desk
        self.store = store
        self.here = here  # judged in this process; False: by `nextstate judge` processes
        self._judging: set[int] = set()  # transitions this process is judging now
        self._renewer = Periodic(RENEW_S, "renew this worker's claims on the judge's inbox", store.renew_claims)
        # a full or read-only disk holds transitions here until it takes them again
        self._writes = Durable("the judge's inbox (transitions)")
        # Transitions handed over but not yet on disk, by response id (feedback looks here too).
        self._arriving: dict[str, Transition] = {}

    async def resume(self) -> int:
        """Judge again what a previous run took but did not finish — this worker's, and any a
        worker sharing the database left when it died — and returns how many. From then on
        this worker's claims are renewed while it lives."""
        if not self.here:
            return 0
        self._renewer.start()
        pending = await asyncio.to_thread(self.store.claim_pending)
        for transition_id, transition in pending:
            self._spawn(transition_id, transition)
        if pending:
            log.info("re-judging %d transitions left over from the last run", len(pending))
        return len(pending)

    async def poll(self, most: int) -> int:
        """A judge process's round: claim pending transitions (oldest first) until `most` are
        being judged here, and judge them; returns how many were claimed. (A judge process
        does not `resume`: that would claim the whole backlog at once.)"""
        self._renewer.start()
        room = most - len(self._judging)
        if room <= 0:
            return 0
        claimed = await asyncio.to_thread(self.store.claim_pending, None, room, False)
        for transition_id, transition in claimed:
            self._spawn(transition_id, transition)
        return len(claimed)

    def _spawn(self, transition_id: int, transition: Transition) -> None:
        if transition_id in self._judging:
            return
        self._judging.add(transition_id)

        async def judged() -> None:
            try:
                await self._judge(transition_id, transition)
            finally:
                self._judging.discard(transition_id)

        self.desk.spawn(judged())

    async def aclose(self) -> None:
        """After the judge's own close: what it did not judge goes back to the inbox, free to take."""
        await self._renewer.stop()
        try:
            await asyncio.to_thread(self.store.release_claims)
        except Exception:  # noqa: BLE001 - the claims then run out on their own (LEASE_S)
            log.warning("could not release this worker's claims on the judge's inbox", exc_info=True)

    def arriving(self, response_id: str) -> Turn | None:
        """The turn of a transition handed over but not on disk yet."""
        transition = self._arriving.get(response_id)
        return transition.turn if transition is not None else None

    # ---------------------------------------------------------------- TransitionSink

    def submit(self, transition: Transition, again: bool = False) -> asyncio.Future[None]:
        """Take a transition; the future resolves once it is safe on disk (the judge's inbox),
        so that whoever handed it over may forget it. Judging follows, off the request path.
        `again`: handed over once more, as a session row read back says it was on its way (it
        usually arrived: the inbox keeps a turn once, quietly)."""
        turn = transition.turn
        durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if turn.response_id:
            self._arriving[turn.response_id] = transition
        if transition.revises:
            # its session settled and went on after all, replacing the next state judged then
            self.desk.spawn(self._revise(transition, durable))
            return durable
        if transition.next_state is None and transition.reason == "session_closed" and turn.track == "outcome":
            # An episode's last step: no next state to vote on, its next state is the outcome.
            self.desk.spawn(self._last_step(transition, durable))
            return durable
        if transition.next_state is None or not self.judge.implicit:
            # Nothing to judge, but kept so that the turn can still be rated explicitly.
            self.desk.spawn(self._keep(transition, durable))
            return durable
        self.desk.spawn(self._accept(transition, durable, again))
        return durable

    async def _take(self, transition: Transition, status: str = "pending") -> int | None:
        """Put `transition` in the inbox and record it; None when the inbox has its turn
        already (a session handed it over again after a restart): recorded the first time."""
        try:
            transition_id = await self._writes.write(self.store.add_transition, transition, status)
        except Exception:
            self.judge.record_transition(transition)  # not kept, but it happened
            raise
        if transition_id is not None:
            self.judge.record_transition(transition)
        return transition_id

    def _handed_over(self, transition: Transition, durable: asyncio.Future[None]) -> None:
        """The transition is on disk (or never will be): feedback looks for it there from now
        on, and whoever handed it over may forget it."""
        self._arriving.pop(transition.turn.response_id or "", None)
        if not durable.done():
            durable.set_result(None)

    async def _keep(self, transition: Transition, durable: asyncio.Future[None]) -> None:
        try:
            await self._take(transition, "unjudged")
        except Exception:  # noqa: BLE001 - beyond the disk's waiting room: only feedback on it is lost
            log.exception("could not keep an unjudged turn")
        finally:
            self._handed_over(transition, durable)

    async def _last_step(self, transition: Transition, durable: asyncio.Future[None]) -> None:
        """Store the last step of an outcome episode as a sample awaiting the outcome (taking it
        at once if the outcome is known): paper §4.4 gives every step o + its process reward,
        and the step most tied to the outcome would otherwise learn nothing from it."""
        try:
            transition_id = await self._take(transition)
            if transition_id is None:
                return
            sample = self.desk.make(transition.turn, "awaiting_outcome", "last step: its next state is the outcome",
                                    0.0, track="outcome")
            await self.desk.store(sample, transition_id)
        except Exception:  # noqa: BLE001 - costs this step's sample only
            log.exception("could not keep the last step of an outcome episode")
        finally:
            self._handed_over(transition, durable)

    async def _revise(self, transition: Transition, durable: asyncio.Future[None]) -> None:
        """Judge a turn again with its revised next state (or keep it unjudged when the revision
        supersedes it), unless it was trained or rated meanwhile: nothing is trained twice."""
        turn = transition.turn
        judged = transition.next_state is not None and self.judge.implicit
        try:
            async with self.desk.turn_lock(turn.response_id):  # not while its first judgement is being stored
                transition_id = await self._writes.write(
                    self.store.revise_transition, transition, "pending" if judged else "unjudged"
                )
            if transition_id is not None:
                self.judge.record_transition(transition)
        except Exception:  # noqa: BLE001 - the earlier judgement stands
            log.exception("could not revise the next state of turn %d of session %s", turn.turn_index, turn.session_id)
            return
        finally:
            self._handed_over(transition, durable)
        if transition_id is not None and judged and self.here:
            await self._judge(transition_id, transition)

    async def _accept(self, transition: Transition, durable: asyncio.Future[None], again: bool = False) -> None:
        try:
            transition_id = await self._take(transition)
            if transition_id is None:  # the inbox has this turn already: it is judged once
                log.log(logging.DEBUG if again else logging.INFO, "turn %d of session %s was handed over again; "
                        "judged once", transition.turn.turn_index, transition.turn.session_id)
                return
        except StorageUnavailable:
            transition_id = None  # judged all the same; only a crash before it is stored loses it
        finally:
            self._handed_over(transition, durable)
        if self.here:  # else a `nextstate judge` process claims it from the inbox
            await self._judge(transition_id, transition)

    async def _judge(self, transition_id: int | None, transition: Transition) -> None:
        judge = self.judge
        if not await judge.verdict():  # stopping before the check ended: the turn stays pending
            return
        if not judge.implicit:  # the judge failed its calibration: the turn waits for explicit feedback
            if transition_id is not None:
                await self._writes.write(self.store.close_transition, transition_id, "unjudged")
            return
        await judge.quiet()
        turn = transition.turn
        async with self.desk.turn_lock(turn.response_id):
            rated, outcome = await asyncio.to_thread(self.store.judging_state, turn.user, turn.response_id, turn.session_id)
            if rated:
                # its user rated it already: their word stands, no judge is asked
                if transition_id is not None:
                    await self._writes.write(self.store.close_transition, transition_id)
                return
            await judge.judge(transition_id, transition, outcome)

