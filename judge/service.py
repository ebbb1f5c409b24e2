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
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from engine.base import Engine
from judge.advantages import opd_delta, token_advantages
from judge.client import JudgeClient
from judge.context import prompt_values
from judge.parsing import majority_vote, parse_hint, parse_score, select_hint
from judge.prompts import PromptLibrary
from judge.teacher import teacher_logprobs
from nextstate.activity import Activity
from nextstate.sample_store import SampleStore, step_reward
from nextstate.settings import Settings
from nextstate.types import Sample, Transition
from proxy.chat_template import ChatRenderer
from proxy.consumers import transition_record
from proxy.records import RecordWriter

log = logging.getLogger(__name__)

HINT_PROMPT = "opd_hint"


@dataclass(frozen=True)
class JudgeConfig:
    mode: Literal["binary", "opd", "combined"] = "combined"
    prm_votes: int = 3
    prm_prompt: str = "prm_personal"
    temperature: float = 0.6
    max_tokens: int = 512
    timeout_s: float = 120.0
    concurrency: int = 4
    max_chars: int = 6000
    min_hint_chars: int = 10
    w_binary: float = 1.0
    w_opd: float = 1.0
    opd_clip: float = 2.0
    opd_teacher: Literal["base", "policy"] = "base"
    enabled: bool = True
    # Judging waits up to this long for no user request to be in flight before it starts.
    quiet_wait_s: float = 2.0

    @classmethod
    def from_settings(cls, s: Settings) -> JudgeConfig:
        return cls(
            mode=s.mode, prm_votes=s.prm_votes, prm_prompt=s.prm_prompt, temperature=s.judge_temperature,
            max_tokens=s.judge_max_tokens, timeout_s=s.judge_timeout_s, concurrency=s.judge_concurrency,
            max_chars=s.judge_max_chars, min_hint_chars=s.min_hint_chars, w_binary=s.w_binary, w_opd=s.w_opd,
            opd_clip=s.opd_clip, opd_teacher=s.opd_teacher, enabled=s.judge_enabled,
        )

    @property
    def uses_prm(self) -> bool:
        return self.mode in ("binary", "combined")

    @property
    def uses_opd(self) -> bool:
        return self.mode in ("opd", "combined")


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
        config: JudgeConfig,
        client: JudgeClient,
        prompts: PromptLibrary,
        engine: Engine,
        renderer: ChatRenderer,
        store: SampleStore,
        records: RecordWriter,
        on_sample: Callable[[Sample], None] | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.prompts = prompts
        self.engine = engine
        self.renderer = renderer
        self.store = store
        self.records = records
        self.on_sample = on_sample
        self.activity = activity or Activity()
        self.stats = JudgeStats()
        prompts.require(config.prm_prompt)
        prompts.require(HINT_PROMPT)
        self._sem = asyncio.Semaphore(config.concurrency)
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

    def submit(self, transition: Transition) -> None:
        turn = transition.turn
        self.records.write("transition", transition_record(transition), version=turn.policy_version)
        if transition.next_state is None or not self.config.enabled:
            # No next state: nothing to judge, and the session is over for the guarantee too.
            if transition.reason == "session_closed":
                self._effective.pop((turn.user, turn.session_id), None)
            return
        self._spawn(self._accept(transition))

    async def _accept(self, transition: Transition) -> None:
        try:
            transition_id = await asyncio.to_thread(self.store.add_transition, transition)
        except Exception:  # noqa: BLE001
            log.exception("could not persist a transition; judging it anyway")
            transition_id = None
        await self._judge(transition_id, transition)

    # ---------------------------------------------------------------- judging

    async def _judge(self, transition_id: int | None, transition: Transition) -> None:
        await self.activity.quiet(self.config.quiet_wait_s)
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
            sample = await asyncio.to_thread(self.store.add_sample, sample, transition_id)
        except Exception:  # noqa: BLE001
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
        cfg, turn, next_state = self.config, transition.turn, transition.next_state
        assert next_state is not None
        detail = {} if detail is None else detail
        values = prompt_values(turn, next_state, cfg.max_chars)
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

    async def _votes(self, prompt: str, values: dict[str, str], allowed: tuple[int, ...]) -> list[Vote]:
        messages = self.prompts.render(prompt, **values)
        return list(await asyncio.gather(*(self._vote(messages, allowed) for _ in range(self.config.prm_votes))))

    async def _vote(self, messages: list[dict[str, str]], allowed: tuple[int, ...]) -> Vote:
        cfg = self.config
        async with self._sem:
            started = time.monotonic()
            error = None
            text = ""
            try:
                text = await asyncio.wait_for(
                    self.client.complete(messages, temperature=cfg.temperature, max_tokens=cfg.max_tokens), cfg.timeout_s
                )
            except asyncio.TimeoutError:
                error = f"timeout after {cfg.timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - a failed vote is just a missing vote
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
        self.stats.votes += 1
        self.stats.vote_seconds.append(seconds)
        score = parse_score(text, allowed) if error is None else None
        if score is None:
            self.stats.votes_failed += 1
        return Vote(score, parse_hint(text) if error is None else None, text, error, round(seconds, 4))

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
            adapter=turn.adapter, mode=self.config.mode, track=track or turn.track, status=status, reason=reason,
            prompt_ids=turn.prompt_ids, response_ids=turn.response_ids, old_logprobs=turn.response_logprobs,
            logprob_temperature=turn.logprob_temperature,
            advantages=advantages if advantages is not None else [0.0] * n,
            loss_mask=[1 if accepted else 0] * n, reward=reward, created_at=time.time(), **extra,
        )


async def _nothing() -> list[Vote]:
    return []
