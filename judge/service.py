"""The judge: how a (turn, next state) transition becomes a stored `Sample`, and whether the
judge can be trusted to do it (its start-up calibration).

It runs entirely off the request path: the inbox (judge/inbox.py) takes each transition onto
disk and decides when it is judged; here the PRM and hint votes run concurrently (bounded, each
with a timeout), the teacher pass scores the response under the hint, and the sample is
stored — accepted or dropped with its reason — in the same transaction that closes the inbox
entry. Any failure costs that vote or that sample, never a request and never the process.
Explicit ratings and outcomes take their own path (judge/feedback.py) and reuse the teacher
pass and the sample's shape from here.

Judging shares the event loop and the cores with serving, so each of those steps first waits
(briefly, `QUIET_WAIT_S` at most) for no request to be in flight: an agent's next request
comes while its last turn is judged, and the steps land in the gaps between requests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from nextstate.core.agent_texts import CODING_AGENT_TOOL_PRM
from nextstate.engine.base import Engine, UnknownAdapterError
from nextstate.judge.advantages import step_reward, token_advantages
from nextstate.judge.client import JudgeClient
from nextstate.judge.calibration import Calibration
from nextstate.judge.context import FENCE_NOTE, Unwrap, prompt_values
from nextstate.judge.hindsight import hindsight_hint, hindsight_placebo
from nextstate.judge.parsing import majority_vote, parse_hint, parse_score, select_hint
from nextstate.judge.prompts import PromptLibrary
from nextstate.judge.samples import SampleDesk
from nextstate.judge.stats import JudgeStats, Vote
from nextstate.judge.teacher import TeacherSignal, teacher_logprobs, teacher_prompt_ids
from nextstate.core.activity import Activity
from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import JudgeSettings
from nextstate.core.types import NextState, Sample, Transition, Turn
from nextstate.modelio.chat_template import ChatRenderer
from nextstate.core.records import RecordWriter

log = logging.getLogger(__name__)

HINT_PROMPT = "opd_hint"
# The PRM of personal agents (the default NEXTSTATE_PRM_PROMPT): one set to another keeps it for every step.
PERSONAL_PRM = "prm_personal"
# Judging waits up to this long for no user request to be in flight before it starts.
QUIET_WAIT_S = 2.0
# A vote's text is kept (records) up to this many characters; a hint up to this many.
MAX_VOTE_TEXT = 4000
MAX_HINT_CHARS = 1000


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
        self.current_adapter = current_adapter  # a user's serving adapter now (the policy teacher's fallback)
        self.activity = activity or Activity()
        self.stats = JudgeStats()
        prompts.require(settings.prm_prompt)
        # a coding agent's tool steps: the general-agent PRM where the prompts have it (a custom
        # folder without it judges them with NEXTSTATE_PRM_PROMPT)
        self._tool_prm = CODING_AGENT_TOOL_PRM if settings.prm_prompt == PERSONAL_PRM and prompts.has(
            CODING_AGENT_TOOL_PRM) else settings.prm_prompt
        prompts.require(HINT_PROMPT)
        # the judge's calls in flight at once (NEXTSTATE_JUDGE_CONCURRENCY): votes, and the
        # teacher passes of ratings with a correction
        self.calls = asyncio.Semaphore(settings.judge_concurrency)
        # the lock per reply, the durable writer and the background work it shares with
        # ratings and the inbox (judge/samples.py)
        self.desk = SampleDesk(settings.mode, store, on_sample)
        self._harness = [re.compile(p) for p in settings.harness_patterns]
        self._unwrap = Unwrap(settings.harness_wrappers)
        # Whether transitions are judged from their next state (implicit feedback); off when
        # judging is disabled, or the judge failed its calibration and no fallback teaches in
        # its place. Explicit feedback always works.
        self.implicit = settings.judge_enabled
        # The judge failed its calibration and next states teach as hints of their own
        # (judge/hindsight.py): no votes are asked, the teacher reads the next state.
        self.hindsight = False
        self.calibration = Calibration()
        # set once the calibration's verdict is in: implicit judging waits for it
        self.calibrated = asyncio.Event()
        # the start-up check being asked (judge/startup_check.py), and shutdown begun: a stop
        # does not wait minutes for a check the next start asks again anyway
        self.checking: asyncio.Task[Any] | None = None
        self._stopping = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    def conclude(self, calibration: Calibration) -> None:
        """The start-up check's verdict (judge/startup_check.py): a failed judge gets no
        implicit work, and implicit judging waits no longer."""
        self.calibration = calibration
        if calibration.state == "failed":
            self.hindsight = self.settings.hindsight_fallback
            self.implicit = self.hindsight
            log.warning("judge: %s", calibration.detail)
            if self.hindsight:
                log.warning("judge: next states teach all the same: each is the OPD hint of the reply before it, "
                            "scored by the served model (NEXTSTATE_JUDGE_FALLBACK=hindsight)")
        self.calibrated.set()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every submitted transition is judged and stored, and every rating applied."""
        await self.desk.tasks.drain(timeout)

    async def verdict(self) -> bool:
        """Wait for the start-up check's verdict; False when the server stops first (what waits
        for it stays pending in the store and is judged after the next start)."""
        if not self.calibrated.is_set():
            waits = {asyncio.ensure_future(self.calibrated.wait()), asyncio.ensure_future(self._stopping.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return self.calibrated.is_set()

    async def aclose(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self.checking is not None:
            self.checking.cancel()  # unconcluded: the next start asks again
        await self.drain(timeout)
        await self.desk.tasks.cancel()  # unfinished ones stay pending in the store
        await self.client.aclose()

    def report(self) -> dict[str, Any]:
        """What the judge did and whether it judges implicit feedback (admin stats, progress)."""
        return {**self.stats.snapshot(), "implicit_feedback": self.implicit, "calibration": self.calibration.to_dict(),
                "fallback": "hindsight" if self.hindsight else None}

    async def quiet(self) -> None:
        """Wait (up to `QUIET_WAIT_S`) for no user request to be in flight: each step of a
        judgement lands in a gap between requests."""
        await self.activity.quiet(QUIET_WAIT_S)

    async def judge(self, transition_id: int | None, transition: Transition, outcome: float | None) -> None:
        """Judge one transition and store its sample, closing its inbox entry (`transition_id`)
        in the same transaction. The caller holds the reply's `turn_lock`."""
        started = time.monotonic()
        detail: dict[str, Any] = {}
        try:
            sample = await self.evaluate(transition, outcome, detail)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judge failure costs this sample only
            log.exception("judging failed")
            self.stats.errors += 1
            sample = self.desk.make(transition.turn, status="dropped", reason=f"judge error: {type(exc).__name__}: {exc}")
        # the votes came back while users may be waiting: storing can wait for a quiet moment too
        await self.quiet()
        try:
            stored = await self.desk.store_judged(sample, transition_id)
        except Exception:  # noqa: BLE001 - beyond the disk waiting room, or a bug: logged, the rest goes on
            log.exception("could not store a sample")
            return
        if stored is None:  # our claim ran out and another worker judged it (a shared database)
            log.warning("transition %s was judged by another worker; this judgement is dropped", transition_id)
            return
        sample = stored
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
        self.desk.notify(sample)

    async def score_correction(self, turn: Turn, correction: str) -> TeacherSignal:
        """A person's correction read by the OPD teacher, as one of the judge's calls (however
        many ratings come at once) in a quiet moment."""
        await self.quiet()
        async with self.calls:
            return await self.teacher(turn, correction)

    async def contrasted_teacher(self, turn: Turn, hint: str, placebo: str,
                                 detail: dict[str, Any] | None = None) -> TeacherSignal:
        """The teacher of `hint`, measured against the same teacher reading `placebo`: what
        copying the hint's words adds cancels."""
        teacher = await self.teacher(turn, hint, detail)
        return teacher.against(await self.teacher(turn, placebo, detail))

    def count_rating(self) -> None:
        self.stats.feedback += 1

    def record_transition(self, transition: Transition) -> None:
        self.records.write("transition", transition.record(), version=transition.turn.policy_version)

    async def evaluate(self, transition: Transition, outcome: float | None, detail: dict[str, Any] | None = None) -> Sample:
        """The sample a transition makes; `outcome` is its session's verifiable outcome, if known."""
        cfg, turn, next_state = self.settings, transition.turn, transition.next_state
        assert next_state is not None
        detail = {} if detail is None else detail
        if notice := self._harness_notice(next_state):
            # The agent's own retry or notice, not its user: the turn produced nothing usable.
            detail["harness_notice"] = notice
            if cfg.mode == "opd":
                return self.desk.make(transition.turn, "dropped", "format failure (the agent's own notice); opd mode needs a hint")
            n = len(turn.response_ids)
            w_binary = 1.0 if cfg.mode == "binary" else cfg.w_binary
            return self.desk.make(
                turn, "ready", "format failure (the agent's own notice)", -1.0,
                token_advantages(n, -1.0, None, w_binary, 0.0),
            )
        outcome_track = turn.track == "outcome" or outcome is not None
        if self.hindsight:
            return await self._hindsight(transition, outcome_track, detail)
        values = prompt_values(turn, next_state, cfg.judge_max_chars, unwrap=self._unwrap)
        want_prm = cfg.uses_prm or outcome_track

        prm = self.prm_prompt(turn, next_state)
        if want_prm and prm != cfg.prm_prompt:
            detail["prm_prompt"] = prm  # a coding agent's tool step (the judgement record says which)
        prm_task = self.votes(prm, values, (1, 0, -1)) if want_prm else _nothing()
        hint_task = self.votes(HINT_PROMPT, values, (1, -1)) if cfg.uses_opd else _nothing()
        prm_votes, hint_votes = await asyncio.gather(prm_task, hint_task)
        detail["votes"] = [asdict(v) for v in prm_votes]
        detail["hint_votes"] = [asdict(v) for v in hint_votes]
        scores = [v.score for v in prm_votes]
        reward = majority_vote(scores) if prm_votes else None
        hint = select_hint([(v.score, v.hint) for v in hint_votes], cfg.min_hint_chars) if hint_votes else None

        teacher = delta = None
        if hint is not None:
            await self.quiet()  # each step of a judgement yields to users anew
            teacher = await self.teacher(turn, hint, detail)
            delta = teacher.delta(turn.response_logprobs, cfg.opd_clip)

        common: dict[str, Any] = {"votes": scores, "hint": hint}
        if outcome_track:
            total = step_reward(outcome, scores) if outcome is not None else float(reward or 0)
            advantages = token_advantages(len(turn.response_ids), total, delta, cfg.w_binary, cfg.w_opd)
            status = "ready" if outcome is not None else "awaiting_outcome"
            reason = "outcome + mean votes" if outcome is not None else "waiting for the session's outcome"
            if teacher is not None:
                common.update(teacher.sample_fields(cfg.w_opd))
            return self.desk.make(transition.turn, status, reason, total, advantages, outcome=outcome, track="outcome", **common)

        if cfg.mode == "binary":
            w_binary, w_opd = 1.0, 0.0
        elif cfg.mode == "opd":
            w_binary, w_opd = 0.0, 1.0
        else:
            w_binary, w_opd = cfg.w_binary, cfg.w_opd
        if teacher is not None:
            common.update(teacher.sample_fields(w_opd))
        if cfg.mode == "opd" and hint is None:
            return self.desk.make(transition.turn, "dropped", "no valid hint", 0.0, **common)
        signal = (reward not in (None, 0)) or teacher is not None
        advantages = token_advantages(len(turn.response_ids), reward, delta, w_binary, w_opd)
        if signal:
            reason = "hint" if reward in (None, 0) else ("reward and hint" if teacher is not None else "reward")
            return self.desk.make(transition.turn, "ready", reason, float(reward or 0), advantages, **common)
        if turn.turn_index == 1:
            # At-least-one guarantee: a session whose turns were all neutral still trains one
            # (zero advantage: only the KL term acts on it, as in the paper's pipeline). The
            # paper keeps a neutral turn when none before it was accepted; its turns are judged
            # in order, ours at once, so "before it" is read by turn index, not by which
            # judgement ends first: the first turn, when neutral. The same conversation then
            # always keeps the same sample.
            return self.desk.make(transition.turn, "ready", "at-least-one guarantee (neutral)", 0.0, advantages, **common)
        return self.desk.make(transition.turn, "dropped", "neutral: reward 0 and no hint", 0.0, **common)

    async def _hindsight(self, transition: Transition, outcome_track: bool, detail: dict[str, Any]) -> Sample:
        """A benched judge's sample: the next state is the hint, the teacher's token-level gap
        the only signal (judge/hindsight.py). No vote is asked, so there is no reward."""
        turn, cfg = transition.turn, self.settings
        if outcome_track:  # o + mean(votes) needs votes: such a step waits for a rating instead
            return self.desk.make(turn, "dropped", "the judge is benched: an outcome step needs its votes")
        hint = hindsight_hint(transition.next_state, MAX_HINT_CHARS, self._unwrap)
        if hint is None:
            return self.desk.make(turn, "dropped", "hindsight: the next state has no words to learn from")
        await self.quiet()
        # what copying the next state's words adds cancels against their placebo (judge/hindsight.py)
        placebo = hindsight_placebo(transition.next_state, MAX_HINT_CHARS, self._unwrap) or hint
        teacher = await self.contrasted_teacher(turn, hint, placebo, detail)
        w_opd = 1.0 if cfg.mode == "opd" else cfg.w_opd
        return self.desk.make(turn, "ready", "hindsight: the next state as the hint (the judge is benched)", 0.0,
                           token_advantages(len(turn.response_ids), None, teacher.delta(turn.response_logprobs,
                                                                                        cfg.opd_clip), 0.0, w_opd),
                           hint=hint, **teacher.sample_fields(w_opd))

    def prm_prompt(self, turn: Turn, next_state: NextState) -> str:
        """The PRM a turn is judged with: a coding agent's step answered by its tool is judged as
        the general agents' are (the environment's feedback on a software-engineering step), a
        person's reaction with NEXTSTATE_PRM_PROMPT."""
        return self._tool_prm if turn.agent is not None and next_state.role == "tool" else self.settings.prm_prompt

    async def teacher(self, turn: Turn, hint: str, detail: dict[str, Any] | None = None) -> TeacherSignal:
        """The OPD teacher's view of the turn: with `opd_loss=topk` only its prompt (the learner
        distils); else its logprobs of the response under the base model or (`opd_teacher=policy`)
        the adapter that served the turn (or the scope's current one, `on_policy_adapter`)."""
        if self.settings.opd_loss == "topk":
            return TeacherSignal(prompt_ids=await teacher_prompt_ids(self.renderer, turn, hint))
        if self.settings.opd_teacher != "policy":
            return TeacherSignal(await teacher_logprobs(self.engine, self.renderer, turn, hint, None))
        return TeacherSignal(await self.on_policy_adapter(turn.user, turn.adapter, lambda adapter: teacher_logprobs(
            self.engine, self.renderer, turn, hint, adapter), detail))

    async def score_under_policy(self, user: str, adapter: str | None, prompt_ids: list[int], response_ids: list[int],
                                 temperature: float) -> list[float]:
        """The logprobs of `response_ids` after `prompt_ids` under `adapter`, the policy that
        wrote them (or the scope's current one, `on_policy_adapter`)."""
        async def score(loaded: str | None) -> list[float]:
            scores = await self.engine.score(prompt_ids + response_ids, len(prompt_ids), adapter=loaded,
                                             temperature=temperature, background=True)
            if len(scores) != len(response_ids):
                raise RuntimeError(f"scored {len(scores)} logprobs for {len(response_ids)} response tokens")
            return scores

        return await self.on_policy_adapter(user, adapter, score)

    async def on_policy_adapter(self, user: str, adapter: str | None, score: Callable[[str | None], Awaitable[list[float]]],
                                detail: dict[str, Any] | None = None) -> list[float]:
        """`score` under `adapter`, the one that served a turn of `user`. It is unloaded once a
        newer version serves and its requests are done, so a turn judged later is scored by
        the version serving its scope now, and the judgement says which."""
        served = adapter
        for _ in range(3):  # a swap may land between looking the version up and scoring with it
            try:
                scores = await score(adapter)
            except UnknownAdapterError:
                current = self.current_adapter(user) if self.current_adapter is not None else None
                if current == adapter:
                    raise
                adapter = current
                continue
            if detail is not None and adapter != served:
                detail["teacher_adapter"] = adapter  # not the one that served: that one is gone
            return scores
        raise UnknownAdapterError(f"no adapter of {user}'s scope stayed loaded long enough to score its reply")

    def _harness_notice(self, next_state: NextState) -> str | None:
        """The first next-state message the agent wrote itself (a harness pattern matches)."""
        for message in next_state.messages:
            text = str(message.get("content") or "")
            if message.get("role") == "user" and any(p.search(text) for p in self._harness):
                return text[:200]
        return None

    async def votes(self, prompt: str, values: dict[str, str], allowed: tuple[int, ...]) -> list[Vote]:
        """m votes on one prompt, asked as one judge call (judge/client.py: `n` answers)."""
        cfg = self.settings
        m = cfg.prm_votes
        messages = self.prompts.render(prompt, **values)
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{FENCE_NOTE}"}
        async with self.calls:
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



async def _nothing() -> list[Vote]:
    return []
