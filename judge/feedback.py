"""Explicit feedback: a person's own verdict on one reply, in place of the judge's.

`POST /v1/feedback` names a reply by its response id, with a rating (+1 good, −1 bad) and
optionally a correction ("do it like this"). The rating is the turn's reward as the judge's
majority vote would be, with no votes taken; the correction plays the judge's hint: the OPD
teacher scores the reply under it, exactly as under a hint the judge wrote. So explicit
feedback works with no judge at all, with a judge that failed its calibration, and in every
mode — a rating alone still teaches in `opd` mode, where a reward alone otherwise would not,
because a person's rating is the least ambiguous signal there is.

An environment's verifiable outcome (`POST /v1/sessions/{id}/outcome`, paper §4.4) is the other
explicit signal: each judged, untrained step of its session gets o + mean(PRM votes).

The rating is on disk before anything else happens with it, and one lock per reply
(`SampleDesk.turn_lock`) orders it with any judgement of the same turn, so the person's word wins.
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from nextstate.core.records import RecordWriter
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import JudgeSettings
from nextstate.core.types import FeedbackResult, FeedbackStatus, Sample, Turn
from nextstate.judge.advantages import token_advantages, with_outcome
from nextstate.judge.inbox import JudgeInbox
from nextstate.judge.samples import SampleDesk
from nextstate.judge.teacher import TeacherSignal


def feedback_weights(mode: str, has_correction: bool, w_binary: float, w_opd: float) -> tuple[float, float]:
    """(binary, OPD) weights of a rated turn's advantages in each mode."""
    if mode == "binary":
        return 1.0, 0.0
    if mode == "opd":
        return (0.0, 1.0) if has_correction else (1.0, 0.0)
    return w_binary, w_opd


class RatingJudge(Protocol):
    """What explicit feedback asks of the judge itself (judge/service.py's `Judge`); the rest
    it shares with every sample's path through the desk (judge/samples.py)."""

    settings: JudgeSettings

    async def score_correction(self, turn: Turn, correction: str) -> TeacherSignal:
        """The OPD teacher's view of the turn's reply under the correction."""

    def count_rating(self) -> None: ...


class ExplicitFeedback:
    """Ratings of replies and outcomes of episodes, turned into samples without votes."""

    def __init__(self, judge: RatingJudge, desk: SampleDesk, inbox: JudgeInbox, store: SampleStore,
                 records: RecordWriter) -> None:
        self.judge = judge
        self.desk = desk
        self.inbox = inbox
        self.store = store
        self.records = records
        self.settings = judge.settings

    async def record_outcome(self, user: str, session_id: str, outcome: float) -> int:
        """A session's verifiable outcome (general agents, paper §4.4): each of its judged,
        untrained steps gets the reward o + mean(PRM votes). Returns how many changed."""
        updated = await asyncio.to_thread(self.store.set_outcome, user, session_id, outcome, with_outcome)
        self.records.write(
            "outcome", {"user": user, "session_id": session_id, "reward": outcome, "samples_updated": updated}
        )
        return updated

    async def apply(
        self, user: str, response_id: str, rating: int, correction: str | None, open_turn: Turn | None = None,
    ) -> FeedbackResult:
        """A person's rating of one of their replies becomes that turn's sample. `open_turn` is
        the turn if its session still holds it.

        The answer comes once the rating is on disk ("accepted"): the sample is made in the
        background, after any judgement of the same turn in progress (the rating wins) and, for
        a correction, the teacher pass, which takes its turn among the judge's calls. A person
        rating fifteen replies waits for fifteen writes, not fifteen teacher passes."""
        turn = open_turn or self.inbox.arriving(response_id)
        if turn is None and (found := await asyncio.to_thread(self.store.find_turn, user, response_id)) is not None:
            turn = found[1].turn
        existing = await asyncio.to_thread(self.store.sample_for_response, user, response_id)
        if turn is None or turn.user != user:
            if existing is not None and existing.status == "consumed":
                return self._recorded(user, response_id, rating, correction, existing, "already_trained")
            return FeedbackResult("not_found")  # unknown, another's, or a sample whose turn expired
        if existing is not None and existing.status == "consumed":
            await self.desk.write(self.store.set_feedback, user, response_id, rating, correction)
            return self._recorded(user, response_id, rating, correction, existing, "already_trained")
        await self.desk.write(self.store.set_feedback, user, response_id, rating, correction)
        self.desk.spawn(self._apply(turn, rating, correction))
        return FeedbackResult("accepted", session_id=turn.session_id, turn_index=turn.turn_index)

    async def _apply(self, turn: Turn, rating: int, correction: str | None) -> FeedbackResult:
        assert turn.response_id is not None
        async with self.desk.turn_lock(turn.response_id):
            existing = await asyncio.to_thread(self.store.sample_for_response, turn.user, turn.response_id)
            if existing is not None and existing.status == "consumed":
                return self._recorded(turn.user, turn.response_id, rating, correction, existing, "already_trained")
            sample = await self._sample(turn, rating, correction)
            if existing is not None and await asyncio.to_thread(self.store.replace_sample, existing.id, sample):
                sample = sample.model_copy(update={"id": existing.id})
                self.desk.notify(sample)
            elif existing is not None:  # trained while the correction was being scored
                return self._recorded(turn.user, turn.response_id, rating, correction, existing, "already_trained")
            else:
                found = await asyncio.to_thread(self.store.find_turn, turn.user, turn.response_id)
                sample = await self.desk.store(sample, found[0] if found else None)
        self.judge.count_rating()
        return self._recorded(turn.user, turn.response_id, rating, correction, sample, "applied")

    async def _sample(self, turn: Turn, rating: int, correction: str | None) -> Sample:
        cfg = self.settings
        teacher = delta = None
        if correction and cfg.uses_opd:
            teacher = await self.judge.score_correction(turn, correction)
            delta = teacher.delta(turn.response_logprobs, cfg.opd_clip)
        w_binary, w_opd = feedback_weights(cfg.mode, teacher is not None, cfg.w_binary, cfg.w_opd)
        advantages = token_advantages(len(turn.response_ids), float(rating), delta, w_binary, w_opd)
        return self.desk.make(
            turn, "ready", "explicit feedback" + (" with a correction" if teacher is not None else ""), float(rating),
            advantages, track="personal", hint=correction, **(teacher.sample_fields(w_opd) if teacher else {}),
            feedback={"rating": rating, "correction": correction},
        )

    def _recorded(
        self, user: str, response_id: str, rating: int, correction: str | None, sample: Sample, status: FeedbackStatus
    ) -> FeedbackResult:
        self.records.write(
            "feedback",
            {"user": user, "response_id": response_id, "session_id": sample.session_id, "turn_index": sample.turn_index,
             "rating": rating, "correction": correction, "status": status, "sample_id": sample.id},
            version=sample.policy_version,
        )
        return FeedbackResult(status, sample.id, sample.session_id, sample.turn_index)
