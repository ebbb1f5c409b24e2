"""The judge: turns each (turn, next state) transition into a stored `Sample`.

It runs entirely off the request path. `submit` only schedules work; the transition is first
written to the durable inbox, then the PRM and hint votes run concurrently (bounded, each
with a timeout), the teacher pass scores the response under the hint, and the sample is
stored — accepted or dropped with its reason — in the same transaction that closes the inbox
entry. Any failure costs that vote or that sample, never a request and never the process.

Judging shares the event loop and the cores with serving, so each of those steps first waits
(briefly, `QUIET_WAIT_S` at most) for no request to be in flight: an agent's next request
comes while its last turn is judged, and the steps land in the gaps between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from nextstate.engine.base import Engine, UnknownAdapterError
from nextstate.judge.advantages import opd_delta, standardize_outcome_batch, step_reward, token_advantages, with_outcome
from nextstate.judge.client import JudgeClient
from nextstate.judge.calibration import CALIBRATION_PROMPT, Calibration, case_values, conclude, judge_case, load_cases
from nextstate.judge.context import FENCE_NOTE, prompt_values
from nextstate.judge.feedback import FeedbackResult, feedback_weights
from nextstate.judge.parsing import majority_vote, parse_hint, parse_score, select_hint
from nextstate.judge.prompts import PromptLibrary
from nextstate.judge.teacher import teacher_logprobs
from nextstate.core.activity import Activity
from nextstate.core.durable import Durable, StorageUnavailable
from nextstate.core.sample_store import SampleStore
from nextstate.core.settings import JudgeSettings
from nextstate.core.types import NextState, Sample, Transition, Turn
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.core.records import RecordWriter

log = logging.getLogger(__name__)

HINT_PROMPT = "opd_hint"
# Judging waits up to this long for no user request to be in flight before it starts.
QUIET_WAIT_S = 2.0
# A vote's text is kept (records) up to this many characters; a hint up to this many.
MAX_VOTE_TEXT = 4000
MAX_HINT_CHARS = 1000


@dataclass
class Vote:
    score: int | None
    hint: str | None
    text: str
    error: str | None
    seconds: float


class JudgeStats:
    """Recent judge latencies (bounded) for /v1/admin/stats."""

    def __init__(self, window: int = 1000) -> None:
        self.sample_seconds: deque[float] = deque(maxlen=window)
        self.call_seconds: deque[float] = deque(maxlen=window)  # one call asks a prompt's m votes
        self.votes = 0
        self.votes_failed = 0
        self.errors = 0
        self.feedback = 0  # explicit ratings applied

    def snapshot(self) -> dict[str, Any]:
        def summary(values: deque[float]) -> dict[str, float] | None:
            if not values:
                return None
            ordered = sorted(values)
            return {
                "mean_s": round(statistics.fmean(ordered), 4),
                "p50_s": round(ordered[len(ordered) // 2], 4),
                "p95_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))], 4),
            }

        return {
            "per_sample": summary(self.sample_seconds),
            "per_call": summary(self.call_seconds),
            "votes": self.votes,
            "votes_failed": self.votes_failed,
            "errors": self.errors,
            "feedback_applied": self.feedback,
        }


class Judge:
    def __init__(
        self,
        settings: JudgeSettings,
        client: JudgeClient,
        prompts: PromptLibrary,
        engine: Engine,
        renderer: ChatRenderer,
        store: SampleStore,
        records: RecordWriter,
        on_sample: Callable[[Sample], None] | None = None,
        activity: Activity | None = None,
        current_adapter: Callable[[str], str | None] | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.prompts = prompts
        self.engine = engine
        self.renderer = renderer
        self.store = store
        self.records = records
        self.on_sample = on_sample
        self.current_adapter = current_adapter  # a user's serving adapter now (the policy teacher's fallback)
        self.activity = activity or Activity()
        self.stats = JudgeStats()
        prompts.require(settings.prm_prompt)
        prompts.require(HINT_PROMPT)
        self._sem = asyncio.Semaphore(settings.judge_concurrency)
        # a full or read-only disk holds transitions and samples here until it takes them again
        self._inbox = Durable("the judge's inbox (transitions)")
        self._samples = Durable("the sample store (judged samples)")
        self._harness = [re.compile(p) for p in settings.harness_patterns]
        self._tasks: set[asyncio.Task] = set()
        # Accepted samples per open session, for the at-least-one guarantee; forgotten when the
        # session closes, but only once its turns still being judged are done (they count too).
        self._effective: dict[tuple[str, str], int] = {}
        self._judging: dict[tuple[str, str], int] = {}
        self._closed: set[tuple[str, str]] = set()
        # Whether transitions are judged from their next state (implicit feedback); off when
        # judging is disabled or the judge failed its calibration. Explicit feedback always works.
        self.implicit = settings.judge_enabled
        # One judgement at a time per reply: the judge's and a person's rating of it never race.
        self._turn_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Transitions handed over but not yet on disk, by response id (feedback looks here too).
        self._arriving: dict[str, Transition] = {}
        self.calibration = Calibration()
        self._calibrated = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Check the judge (judge/calibration.py), off the start-up path, and re-judge
        transitions a previous run accepted but did not finish."""
        if not self.settings.judge_enabled or not self.settings.judge_calibration:
            why = "judging is off (NEXTSTATE_JUDGE_ENABLED=false)" if not self.settings.judge_enabled else (
                "not checked (NEXTSTATE_JUDGE_CALIBRATION=false)")
            self.calibration = Calibration("skipped", why)
            self._calibrated.set()
            await self._remember_calibration()
        else:
            self._spawn(self.calibrate())
        pending = await asyncio.to_thread(self.store.pending_transitions)
        for transition_id, transition in pending:
            self._spawn(self._judge(transition_id, transition))
        if pending:
            log.info("re-judging %d transitions left over from the last run", len(pending))
        return len(pending)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted transition is judged and stored."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._tasks:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait(set(self._tasks), timeout=remaining)
            if deadline is not None and time.monotonic() >= deadline:
                return

    async def aclose(self, timeout: float = 10.0) -> None:
        await self.drain(timeout)
        for task in list(self._tasks):  # unfinished ones stay pending in the store
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    async def calibrate(self) -> Calibration:
        """Ask the judge the calibration cases; implicit judging waits for the verdict."""
        started = time.monotonic()
        try:
            if not (self.prompts.directory / "calibration.json").is_file():
                self.calibration = Calibration("skipped", f"no calibration.json in {self.prompts.directory}")
                return self.calibration
            cases = load_cases(self.prompts.directory)
            log.info("judge: checking it on %d calibration cases before it scores any turn", len(cases))
            results = []
            for case in cases:  # one case at a time: the first one wrong settles it, at a quarter of the cost
                votes = await self._votes(CALIBRATION_PROMPT, case_values(case, self.settings.judge_max_chars), (1, 0, -1))
                results.append(judge_case(case, [v.score for v in votes]))
                if not results[-1].passed:
                    break
            self.calibration = conclude(results, time.monotonic() - started, asked_of=len(cases))
            if self.calibration.state == "failed":
                self.implicit = False
                log.warning("judge: %s", self.calibration.detail)
            else:
                log.info("judge: %s (%.1f s)", self.calibration.detail, self.calibration.seconds)
            self.records.write("judge_calibration", self.calibration.to_dict())
            return self.calibration
        except Exception as exc:  # noqa: BLE001 - a check that cannot run leaves the judge as configured
            log.warning("judge: the calibration could not run (%s: %s); judging goes on unchecked", type(exc).__name__, exc)
            self.calibration = Calibration("skipped", f"could not run: {type(exc).__name__}: {exc}")
            return self.calibration
        finally:
            self._calibrated.set()
            await self._remember_calibration()

    async def _remember_calibration(self) -> None:
        try:  # for `nextstate status`, which reads the data dir
            await asyncio.to_thread(self.store.set_meta, "judge_calibration", self.calibration.to_dict())
        except Exception:  # noqa: BLE001 - a fact for display, not worth failing anything
            log.warning("could not keep the judge's calibration in the sample store", exc_info=True)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- TransitionConsumer

    def submit(self, transition: Transition) -> asyncio.Future:
        """Take a transition; the future resolves once it is safe on disk (the judge's inbox),
        so that whoever handed it over may forget it. Judging follows, off the request path."""
        turn = transition.turn
        durable = asyncio.get_running_loop().create_future()
        if turn.response_id:
            self._arriving[turn.response_id] = transition
        if transition.next_state is None and transition.reason == "session_closed" and turn.track == "outcome":
            # An episode's last step: no next state to vote on, its next state is the outcome.
            self._spawn(self._last_step(transition, durable))
            return durable
        if transition.next_state is None or not self.implicit:
            # Nothing to judge (and the session is over for the guarantee too), but kept so that
            # the turn can still be rated explicitly.
            if transition.reason == "session_closed":
                self._session_over((turn.user, turn.session_id))
            self._spawn(self._keep(transition, durable))
            return durable
        key = (turn.user, turn.session_id)
        self._judging[key] = self._judging.get(key, 0) + 1
        self._spawn(self._accept(transition, durable))
        return durable

    async def _take(self, transition: Transition, status: str = "pending") -> int | None:
        """Put `transition` in the inbox and record it; None when the inbox has its turn
        already (a session handed it over again after a restart): recorded the first time."""
        try:
            transition_id = await self._inbox.write(self.store.add_transition, transition, status)
        except Exception:
            self._record(transition)  # not kept, but it happened
            raise
        if transition_id is not None:
            self._record(transition)
        return transition_id

    def _record(self, transition: Transition) -> None:
        self.records.write("transition", transition.record(), version=transition.turn.policy_version)

    def _session_over(self, key: tuple[str, str]) -> None:
        if self._judging.get(key):
            self._closed.add(key)  # forgotten when its last judgement ends
        else:
            self._effective.pop(key, None)

    def _handed_over(self, transition: Transition, durable: asyncio.Future) -> None:
        """The transition is on disk (or never will be): feedback looks for it there from now
        on, and whoever handed it over may forget it."""
        self._arriving.pop(transition.turn.response_id or "", None)
        if not durable.done():
            durable.set_result(None)

    async def _keep(self, transition: Transition, durable: asyncio.Future) -> None:
        try:
            await self._take(transition, "unjudged")
        except Exception:  # noqa: BLE001 - beyond the disk's waiting room: only feedback on it is lost
            log.exception("could not keep an unjudged turn")
        finally:
            self._handed_over(transition, durable)

    async def _last_step(self, transition: Transition, durable: asyncio.Future) -> None:
        """Store the last step of an outcome episode as a sample awaiting the outcome (taking it
        at once if the outcome is known): paper §4.4 gives every step o + its process reward,
        and the step most tied to the outcome would otherwise learn nothing from it."""
        try:
            transition_id = await self._take(transition)
            if transition_id is None:
                return
            sample = self._sample(transition.turn, "awaiting_outcome", "last step: its next state is the outcome", 0.0,
                                  track="outcome")
            sample = await self._samples.write(self.store.add_sample, sample, transition_id, with_outcome)
            if self.on_sample is not None:
                self.on_sample(sample)
        except Exception:  # noqa: BLE001 - costs this step's sample only
            log.exception("could not keep the last step of an outcome episode")
        finally:
            self._handed_over(transition, durable)

    async def _accept(self, transition: Transition, durable: asyncio.Future) -> None:
        try:
            try:
                transition_id = await self._take(transition)
                if transition_id is None:  # the inbox has this turn already: it is judged once
                    log.info("turn %d of session %s was handed over again; judged once", transition.turn.turn_index,
                             transition.turn.session_id)
                    return
            except StorageUnavailable:
                transition_id = None  # judged all the same; only a crash before it is stored loses it
            finally:
                self._handed_over(transition, durable)
            await self._judge(transition_id, transition)
        finally:
            key = (transition.turn.user, transition.turn.session_id)
            self._judging[key] -= 1
            if not self._judging[key]:
                del self._judging[key]
                if key in self._closed:
                    self._closed.discard(key)
                    self._effective.pop(key, None)

    # ---------------------------------------------------------------- outcomes and batches

    async def record_outcome(self, user: str, session_id: str, outcome: float) -> int:
        """A session's verifiable outcome (general agents, paper §4.4): each of its judged,
        untrained steps gets the reward o + mean(PRM votes). Returns how many changed."""
        updated = await asyncio.to_thread(self.store.set_outcome, user, session_id, outcome, with_outcome)
        self.records.write(
            "outcome", {"user": user, "session_id": session_id, "reward": outcome, "samples_updated": updated}
        )
        return updated

    # ---------------------------------------------------------------- explicit feedback

    async def apply_feedback(
        self, user: str, response_id: str, rating: int, correction: str | None, open_turn: Turn | None = None,
        wait_s: float = 30.0,
    ) -> FeedbackResult:
        """A person's rating of one of their replies becomes that turn's sample (see
        judge/feedback.py). `open_turn` is the turn if its session still holds it.

        The rating is kept on disk first; applying it waits for any judgement of the same turn
        in progress, up to `wait_s` — past that the answer is "queued" and it lands later."""
        turn = open_turn
        if turn is None and response_id in self._arriving:
            turn = self._arriving[response_id].turn
        if turn is None and (found := await asyncio.to_thread(self.store.find_turn, user, response_id)) is not None:
            turn = found[1].turn
        if turn is None or turn.user != user:
            existing = await asyncio.to_thread(self.store.sample_for_response, user, response_id)
            if existing is None:
                return FeedbackResult("not_found")
            if existing.status == "consumed":
                return self._feedback_recorded(user, response_id, rating, correction, existing, "already_trained")
            return FeedbackResult("not_found")  # a sample whose turn expired: nothing to rebuild it from
        await self._samples.write(self.store.set_feedback, user, response_id, rating, correction)
        task = asyncio.ensure_future(self._apply_feedback(turn, rating, correction))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except asyncio.TimeoutError:
            return FeedbackResult("queued", session_id=turn.session_id, turn_index=turn.turn_index)

    async def _apply_feedback(self, turn: Turn, rating: int, correction: str | None) -> FeedbackResult:
        assert turn.response_id is not None
        async with self._turn_lock(turn.response_id):
            existing = await asyncio.to_thread(self.store.sample_for_response, turn.user, turn.response_id)
            if existing is not None and existing.status == "consumed":
                return self._feedback_recorded(turn.user, turn.response_id, rating, correction, existing, "already_trained")
            sample = await self._feedback_sample(turn, rating, correction)
            if existing is not None and await asyncio.to_thread(self.store.replace_sample, existing.id, sample):
                sample = sample.model_copy(update={"id": existing.id})
            elif existing is not None:  # trained while the correction was being scored
                return self._feedback_recorded(turn.user, turn.response_id, rating, correction, existing, "already_trained")
            else:
                found = await asyncio.to_thread(self.store.find_turn, turn.user, turn.response_id)
                sample = await self._samples.write(self.store.add_sample, sample, found[0] if found else None)
        self.stats.feedback += 1
        result = self._feedback_recorded(turn.user, turn.response_id, rating, correction, sample, "applied")
        if self.on_sample is not None:
            self.on_sample(sample)
        return result

    async def _feedback_sample(self, turn: Turn, rating: int, correction: str | None) -> Sample:
        cfg = self.settings
        teacher = delta = None
        if correction and cfg.uses_opd:
            teacher = await self._teacher(turn, correction)
            delta = opd_delta(teacher, turn.response_logprobs, cfg.opd_clip)
        w_binary, w_opd = feedback_weights(cfg.mode, delta is not None, cfg.w_binary, cfg.w_opd)
        advantages = token_advantages(len(turn.response_ids), float(rating), delta, w_binary, w_opd)
        return self._sample(
            turn, "ready", "explicit feedback" + (" with a correction" if delta is not None else ""), float(rating),
            advantages, track="personal", hint=correction, teacher_logprobs=teacher,
            feedback={"rating": rating, "correction": correction},
        )

    def _feedback_recorded(
        self, user: str, response_id: str, rating: int, correction: str | None, sample: Sample, status: str
    ) -> FeedbackResult:
        self.records.write(
            "feedback",
            {"user": user, "response_id": response_id, "session_id": sample.session_id, "turn_index": sample.turn_index,
             "rating": rating, "correction": correction, "status": status, "sample_id": sample.id},
            version=sample.policy_version,
        )
        return FeedbackResult(status, sample.id, sample.session_id, sample.turn_index)  # type: ignore[arg-type]

    def prepare_batch(self, samples: list[Sample]) -> list[Sample]:
        """The advantages a training batch trains on: outcome rewards are standardised per
        step index across the batch here, at batch time, because only then is the group known."""
        s = self.settings
        return standardize_outcome_batch(samples, s.w_binary, s.w_opd, s.opd_clip)

    # ---------------------------------------------------------------- judging

    def _turn_lock(self, response_id: str | None):
        if not response_id:
            return contextlib.nullcontext()
        lock = self._turn_locks.get(response_id)
        if lock is None:
            lock = self._turn_locks[response_id] = asyncio.Lock()
        return lock

    async def _judge(self, transition_id: int | None, transition: Transition) -> None:
        await self._calibrated.wait()
        if not self.implicit:  # the judge failed its calibration: the turn waits for explicit feedback
            if transition_id is not None:
                await self._inbox.write(self.store.close_transition, transition_id, "unjudged")
            return
        await self.activity.quiet(QUIET_WAIT_S)
        turn = transition.turn
        async with self._turn_lock(turn.response_id):
            rated, outcome = await asyncio.to_thread(self.store.judging_state, turn.user, turn.response_id, turn.session_id)
            if rated:
                # its user rated it already: their word stands, no judge is asked
                if transition_id is not None:
                    await self._inbox.write(self.store.close_transition, transition_id)
                return
            await self._judge_unlocked(transition_id, transition, outcome)

    async def _judge_unlocked(self, transition_id: int | None, transition: Transition, outcome: float | None) -> None:
        started = time.monotonic()
        detail: dict[str, Any] = {}
        try:
            sample = await self.evaluate(transition, outcome, detail)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judge failure costs this sample only
            log.exception("judging failed")
            self.stats.errors += 1
            sample = self._sample(transition.turn, status="dropped", reason=f"judge error: {type(exc).__name__}: {exc}")
        # the votes came back while users may be waiting: storing can wait for a quiet moment too
        await self.activity.quiet(QUIET_WAIT_S)
        try:
            sample = await self._samples.write(self.store.add_sample, sample, transition_id, with_outcome)
        except Exception:  # noqa: BLE001 - beyond the disk waiting room, or a bug: logged, the rest goes on
            log.exception("could not store a sample")
            return
        seconds = time.monotonic() - started
        self.stats.sample_seconds.append(seconds)
        turn = transition.turn
        self.records.write(
            "judgement",
            {
                "sample_id": sample.id, "user": turn.user, "session_id": turn.session_id, "turn_index": turn.turn_index,
                "mode": sample.mode, "track": sample.track, "status": sample.status, "reason": sample.reason,
                "reward": sample.reward, "hint": sample.hint, "seconds": round(seconds, 4),
                "advantage_mean": round(statistics.fmean(sample.advantages), 6) if sample.advantages else None,
                **detail,
            },
            version=turn.policy_version,
        )
        if self.on_sample is not None:
            self.on_sample(sample)

    async def evaluate(self, transition: Transition, outcome: float | None, detail: dict[str, Any] | None = None) -> Sample:
        """The sample a transition makes; `outcome` is its session's verifiable outcome, if known."""
        cfg, turn, next_state = self.settings, transition.turn, transition.next_state
        assert next_state is not None
        detail = {} if detail is None else detail
        if notice := self._harness_notice(next_state):
            # The agent's own retry or notice, not its user: the turn produced nothing usable.
            detail["harness_notice"] = notice
            if cfg.mode == "opd":
                return self._sample(transition.turn, "dropped", "format failure (the agent's own notice); opd mode needs a hint")
            n = len(turn.response_ids)
            w_binary = 1.0 if cfg.mode == "binary" else cfg.w_binary
            key = (turn.user, turn.session_id)
            self._effective[key] = self._effective.get(key, 0) + 1
            return self._sample(
                turn, "ready", "format failure (the agent's own notice)", -1.0,
                token_advantages(n, -1.0, None, w_binary, 0.0),
            )
        values = prompt_values(turn, next_state, cfg.judge_max_chars)
        outcome_track = turn.track == "outcome" or outcome is not None
        want_prm = cfg.uses_prm or outcome_track

        prm_task = self._votes(cfg.prm_prompt, values, (1, 0, -1)) if want_prm else _nothing()
        hint_task = self._votes(HINT_PROMPT, values, (1, -1)) if cfg.uses_opd else _nothing()
        prm_votes, hint_votes = await asyncio.gather(prm_task, hint_task)
        detail["votes"] = [asdict(v) for v in prm_votes]
        detail["hint_votes"] = [asdict(v) for v in hint_votes]
        scores = [v.score for v in prm_votes]
        reward = majority_vote(scores) if prm_votes else None
        hint = select_hint([(v.score, v.hint) for v in hint_votes], cfg.min_hint_chars) if hint_votes else None

        teacher = delta = None
        if hint is not None:
            await self.activity.quiet(QUIET_WAIT_S)  # each step of a judgement yields to users anew
            teacher = await self._teacher(turn, hint, detail)
            delta = opd_delta(teacher, turn.response_logprobs, cfg.opd_clip)

        common = {"votes": scores, "hint": hint, "teacher_logprobs": teacher}
        if outcome_track:
            total = step_reward(outcome, scores) if outcome is not None else float(reward or 0)
            advantages = token_advantages(len(turn.response_ids), total, delta, cfg.w_binary, cfg.w_opd)
            status = "ready" if outcome is not None else "awaiting_outcome"
            reason = "outcome + mean votes" if outcome is not None else "waiting for the session's outcome"
            return self._sample(transition.turn, status, reason, total, advantages, outcome=outcome, track="outcome", **common)

        if cfg.mode == "binary":
            w_binary, w_opd = 1.0, 0.0
        elif cfg.mode == "opd":
            w_binary, w_opd = 0.0, 1.0
        else:
            w_binary, w_opd = cfg.w_binary, cfg.w_opd
        if cfg.mode == "opd" and hint is None:
            return self._sample(transition.turn, "dropped", "no valid hint", 0.0, **common)
        signal = (reward not in (None, 0)) or delta is not None
        advantages = token_advantages(len(turn.response_ids), reward, delta, w_binary, w_opd)
        key = (turn.user, turn.session_id)
        if signal:
            self._effective[key] = self._effective.get(key, 0) + 1
            reason = "hint" if reward in (None, 0) else ("reward and hint" if delta is not None else "reward")
            return self._sample(transition.turn, "ready", reason, float(reward or 0), advantages, **common)
        if self._effective.get(key, 0) == 0:
            # At-least-one guarantee: a session whose turns were all neutral still trains one
            # (zero advantage: only the KL term acts on it, as in the paper's pipeline).
            self._effective[key] = 1
            return self._sample(transition.turn, "ready", "at-least-one guarantee (neutral)", 0.0, advantages, **common)
        return self._sample(transition.turn, "dropped", "neutral: reward 0 and no hint", 0.0, **common)

    async def _teacher(self, turn: Turn, hint: str, detail: dict[str, Any] | None = None) -> list[float]:
        """The OPD teacher's logprobs: the base model, or (`opd_teacher=policy`) the adapter
        that served the turn. That adapter is unloaded once a newer version serves and its
        requests are done, so a turn judged later is scored by the version serving its scope
        now, and the judgement says which."""
        if self.settings.opd_teacher != "policy":
            return await teacher_logprobs(self.engine, self.renderer, turn, hint, None)
        adapter = turn.adapter
        for _ in range(3):  # a swap may land between looking the version up and scoring with it
            try:
                scores = await teacher_logprobs(self.engine, self.renderer, turn, hint, adapter)
            except UnknownAdapterError:
                current = self.current_adapter(turn.user) if self.current_adapter is not None else None
                if current == adapter:
                    raise
                adapter = current
                continue
            if detail is not None and adapter != turn.adapter:
                detail["teacher_adapter"] = adapter  # not the one that served: that one is gone
            return scores
        raise UnknownAdapterError(f"no adapter of {turn.user}'s scope stayed loaded long enough to score a teacher pass")

    def _harness_notice(self, next_state: NextState) -> str | None:
        """The first next-state message the agent wrote itself (a harness pattern matches)."""
        for message in next_state.messages:
            text = str(message.get("content") or "")
            if message.get("role") == "user" and any(p.search(text) for p in self._harness):
                return text[:200]
        return None

    async def _votes(self, prompt: str, values: dict[str, str], allowed: tuple[int, ...]) -> list[Vote]:
        """m votes on one prompt, asked as one judge call (judge/client.py: `n` answers)."""
        cfg = self.settings
        m = cfg.prm_votes
        messages = self.prompts.render(prompt, **values)
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{FENCE_NOTE}"}
        async with self._sem:
            started = time.monotonic()
            error = None
            texts: list[str] = []
            try:
                texts = await asyncio.wait_for(
                    self.client.complete(messages, temperature=cfg.judge_temperature, max_tokens=cfg.judge_max_tokens, n=m),
                    cfg.judge_timeout_s,
                )
            except asyncio.TimeoutError:
                error = f"timeout after {cfg.judge_timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - failed votes are just missing votes
                error = f"{type(exc).__name__}: {exc}"
            seconds = round(time.monotonic() - started, 4)
        self.stats.call_seconds.append(seconds)
        return [self._vote(texts[i] if i < len(texts) else "", error, allowed, seconds) for i in range(m)]

    def _vote(self, text: str, error: str | None, allowed: tuple[int, ...], seconds: float) -> Vote:
        self.stats.votes += 1
        score = parse_score(text, allowed) if error is None else None
        if score is None:
            self.stats.votes_failed += 1
        hint = parse_hint(text) if error is None else None
        # what is kept of a vote is bounded: a judge that rambles for megabytes costs a line
        return Vote(score, hint[:MAX_HINT_CHARS] if hint else hint, text[:MAX_VOTE_TEXT], error, seconds)

    def _sample(
        self,
        turn: Turn,
        status: str,
        reason: str,
        reward: float = 0.0,
        advantages: list[float] | None = None,
        track: str | None = None,
        **extra: Any,
    ) -> Sample:
        n = len(turn.response_ids)
        accepted = status != "dropped"
        return Sample(
            user=turn.user, session_id=turn.session_id, turn_index=turn.turn_index, policy_version=turn.policy_version,
            adapter=turn.adapter, mode=self.settings.mode, track=track or turn.track, status=status, reason=reason,
            prompt_ids=turn.prompt_ids, response_ids=turn.response_ids, old_logprobs=turn.response_logprobs,
            logprob_temperature=turn.logprob_temperature,
            advantages=advantages if advantages is not None else [0.0] * n,
            loss_mask=[1 if accepted else 0] * n, reward=reward, response_id=turn.response_id, created_at=time.time(),
            **extra,
        )


async def _nothing() -> list[Vote]:
    return []
