"""The judge: turns each (turn, next state) transition into a stored `Sample`.

It runs entirely off the request path. `submit` only schedules work; the transition is first
written to the durable inbox, then the PRM and hint votes run concurrently (bounded, each
with a timeout), the teacher pass scores the response under the hint, and the sample is
stored — accepted or dropped with its reason — in the same transaction that closes the inbox
entry. Any failure costs that vote or that sample, never a request and never the process.
"""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from nextstate.engine.base import Engine
from nextstate.judge.advantages import opd_delta, standardize_outcome_batch, step_reward, token_advantages, with_outcome
from nextstate.judge.client import JudgeClient
from nextstate.judge.context import FENCE_NOTE, prompt_values
from nextstate.judge.parsing import majority_vote, parse_hint, parse_score, select_hint
from nextstate.judge.prompts import PromptLibrary
from nextstate.judge.teacher import teacher_logprobs
from nextstate.core.activity import Activity
from nextstate.core.durable import Durable, StorageUnavailable
from nextstate.core.sample_store import SampleStore
from nextstate.core.settings import JudgeSettings
from nextstate.core.types import NextState, Sample, Transition
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
        self.vote_seconds: deque[float] = deque(maxlen=window)
        self.votes = 0
        self.votes_failed = 0
        self.errors = 0

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
            "per_vote": summary(self.vote_seconds),
            "votes": self.votes,
            "votes_failed": self.votes_failed,
            "errors": self.errors,
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
    ) -> None:
        self.settings = settings
        self.client = client
        self.prompts = prompts
        self.engine = engine
        self.renderer = renderer
        self.store = store
        self.records = records
        self.on_sample = on_sample
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
        # Accepted samples per open session, for the at-least-one guarantee.
        self._effective: dict[tuple[str, str], int] = {}

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Re-judge transitions a previous run accepted but did not finish."""
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
        self.records.write("transition", transition.record(), version=turn.policy_version)
        if transition.next_state is None or not self.settings.judge_enabled:
            # No next state: nothing to judge, and the session is over for the guarantee too.
            if transition.reason == "session_closed":
                self._effective.pop((turn.user, turn.session_id), None)
            durable.set_result(None)
            return durable
        self._spawn(self._accept(transition, durable))
        return durable

    async def _accept(self, transition: Transition, durable: asyncio.Future) -> None:
        try:
            transition_id = await self._inbox.write(self.store.add_transition, transition)
            if transition_id is None:  # the inbox has this turn already: it is judged once
                log.info("turn %d of session %s was handed over again; judged once", transition.turn.turn_index,
                         transition.turn.session_id)
                return
        except StorageUnavailable:
            transition_id = None  # judged all the same; only a crash before it is stored loses it
        finally:
            if not durable.done():
                durable.set_result(None)
        await self._judge(transition_id, transition)

    # ---------------------------------------------------------------- outcomes and batches

    async def record_outcome(self, user: str, session_id: str, outcome: float) -> int:
        """A session's verifiable outcome (general agents, paper §4.4): each of its judged,
        untrained steps gets the reward o + mean(PRM votes). Returns how many changed."""
        updated = await asyncio.to_thread(self.store.set_outcome, user, session_id, outcome, with_outcome)
        self.records.write(
            "outcome", {"user": user, "session_id": session_id, "reward": outcome, "samples_updated": updated}
        )
        return updated

    def prepare_batch(self, samples: list[Sample]) -> list[Sample]:
        """The advantages a training batch trains on: outcome rewards are standardised per
        step index across the batch here, at batch time, because only then is the group known."""
        s = self.settings
        return standardize_outcome_batch(samples, s.w_binary, s.w_opd, s.opd_clip)

    # ---------------------------------------------------------------- judging

    async def _judge(self, transition_id: int | None, transition: Transition) -> None:
        await self.activity.quiet(QUIET_WAIT_S)
        started = time.monotonic()
        detail: dict[str, Any] = {}
        try:
            sample = await self.evaluate(transition, detail)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judge failure costs this sample only
            log.exception("judging failed")
            self.stats.errors += 1
            sample = self._sample(transition, status="dropped", reason=f"judge error: {type(exc).__name__}: {exc}")
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

    async def evaluate(self, transition: Transition, detail: dict[str, Any] | None = None) -> Sample:
        cfg, turn, next_state = self.settings, transition.turn, transition.next_state
        assert next_state is not None
        detail = {} if detail is None else detail
        if notice := self._harness_notice(next_state):
            # The agent's own retry or notice, not its user: the turn produced nothing usable.
            detail["harness_notice"] = notice
            if cfg.mode == "opd":
                return self._sample(transition, "dropped", "format failure (the agent's own notice); opd mode needs a hint")
            n = len(turn.response_ids)
            w_binary = 1.0 if cfg.mode == "binary" else cfg.w_binary
            key = (turn.user, turn.session_id)
            self._effective[key] = self._effective.get(key, 0) + 1
            return self._sample(
                transition, "ready", "format failure (the agent's own notice)", -1.0,
                token_advantages(n, -1.0, None, w_binary, 0.0),
            )
        values = prompt_values(turn, next_state, cfg.judge_max_chars)
        outcome = await asyncio.to_thread(self.store.get_outcome, turn.user, turn.session_id)
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
            adapter = turn.adapter if cfg.opd_teacher == "policy" else None
            teacher = await teacher_logprobs(self.engine, self.renderer, turn, hint, adapter)
            delta = opd_delta(teacher, turn.response_logprobs, cfg.opd_clip)

        common = {"votes": scores, "hint": hint, "teacher_logprobs": teacher}
        if outcome_track:
            total = step_reward(outcome, scores) if outcome is not None else float(reward or 0)
            advantages = token_advantages(len(turn.response_ids), total, delta, cfg.w_binary, cfg.w_opd)
            status = "ready" if outcome is not None else "awaiting_outcome"
            reason = "outcome + mean votes" if outcome is not None else "waiting for the session's outcome"
            return self._sample(transition, status, reason, total, advantages, outcome=outcome, track="outcome", **common)

        if cfg.mode == "binary":
            w_binary, w_opd = 1.0, 0.0
        elif cfg.mode == "opd":
            w_binary, w_opd = 0.0, 1.0
        else:
            w_binary, w_opd = cfg.w_binary, cfg.w_opd
        if cfg.mode == "opd" and hint is None:
            return self._sample(transition, "dropped", "no valid hint", 0.0, **common)
        signal = (reward not in (None, 0)) or delta is not None
        advantages = token_advantages(len(turn.response_ids), reward, delta, w_binary, w_opd)
        key = (turn.user, turn.session_id)
        if signal:
            self._effective[key] = self._effective.get(key, 0) + 1
            reason = "hint" if reward in (None, 0) else ("reward and hint" if delta is not None else "reward")
            return self._sample(transition, "ready", reason, float(reward or 0), advantages, **common)
        if self._effective.get(key, 0) == 0:
            # At-least-one guarantee: a session whose turns were all neutral still trains one
            # (zero advantage: only the KL term acts on it, as in the paper's pipeline).
            self._effective[key] = 1
            return self._sample(transition, "ready", "at-least-one guarantee (neutral)", 0.0, advantages, **common)
        return self._sample(transition, "dropped", "neutral: reward 0 and no hint", 0.0, **common)

    def _harness_notice(self, next_state: NextState) -> str | None:
        """The first next-state message the agent wrote itself (a harness pattern matches)."""
        for message in next_state.messages:
            text = str(message.get("content") or "")
            if message.get("role") == "user" and any(p.search(text) for p in self._harness):
                return text[:200]
        return None

    async def _votes(self, prompt: str, values: dict[str, str], allowed: tuple[int, ...]) -> list[Vote]:
        messages = self.prompts.render(prompt, **values)
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{FENCE_NOTE}"}
        return list(await asyncio.gather(*(self._vote(messages, allowed) for _ in range(self.settings.prm_votes))))

    async def _vote(self, messages: list[dict[str, str]], allowed: tuple[int, ...]) -> Vote:
        cfg = self.settings
        async with self._sem:
            started = time.monotonic()
            error = None
            text = ""
            try:
                text = await asyncio.wait_for(
                    self.client.complete(messages, temperature=cfg.judge_temperature, max_tokens=cfg.judge_max_tokens), cfg.judge_timeout_s
                )
            except asyncio.TimeoutError:
                error = f"timeout after {cfg.judge_timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - a failed vote is just a missing vote
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
        self.stats.votes += 1
        self.stats.vote_seconds.append(seconds)
        score = parse_score(text, allowed) if error is None else None
        if score is None:
            self.stats.votes_failed += 1
        hint = parse_hint(text) if error is None else None
        # what is kept of a vote is bounded: a judge that rambles for megabytes costs a line
        return Vote(score, hint[:MAX_HINT_CHARS] if hint else hint, text[:MAX_VOTE_TEXT], error, round(seconds, 4))

    def _sample(
        self,
        transition: Transition,
        status: str,
        reason: str,
        reward: float = 0.0,
        advantages: list[float] | None = None,
        track: str | None = None,
        **extra: Any,
    ) -> Sample:
        turn = transition.turn
        n = len(turn.response_ids)
        accepted = status != "dropped"
        return Sample(
            user=turn.user, session_id=turn.session_id, turn_index=turn.turn_index, policy_version=turn.policy_version,
            adapter=turn.adapter, mode=self.settings.mode, track=track or turn.track, status=status, reason=reason,
            prompt_ids=turn.prompt_ids, response_ids=turn.response_ids, old_logprobs=turn.response_logprobs,
            logprob_temperature=turn.logprob_temperature,
            advantages=advantages if advantages is not None else [0.0] * n,
            loss_mask=[1 if accepted else 0] * n, reward=reward, created_at=time.time(), **extra,
        )


async def _nothing() -> list[Vote]:
    return []
