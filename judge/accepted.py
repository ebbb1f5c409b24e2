"""The reply a person accepted after a correction, as evidence for the turn it corrected.

A person who answers a reply with a correction ("No, in one short sentence please") and then
accepts the next reply has shown what they wanted on the corrected turn's own prompt. The
turn-level samples teach around that: the corrected reply is pushed down, and the accepted one
is pushed up, but on a prompt that holds the correction, one the policy rarely sees again. What
the person wants is a first reply that needs no correction, so the accepted reply also becomes
a sample on the corrected turn's prompt: that turn's prompt, the accepted turn's response, the
accepted turn's reward.

This is context distillation at the sequence level (Snell et al. 2022, "Learning by Distilling
Context"): the reply the policy wrote when it could read the correction, taught to it without
the correction, and kept only when the person accepted it, like rejection sampling's positive
examples (RAFT, Dong et al. 2023). It is the counterpart of the OPD teacher, which reads the
correction as a hint token by token (OpenClaw-RL §4.2) and of its OEL track's
experience-augmented teacher. It needs a verdict on both turns, a judge's or the person's own
rating: a benched judge's hindsight hints say nothing about acceptance, so they make none.

Its old logprobs are the serving policy's own scores of that response on that prompt. PPO's
ratio starts at 1 there, and its clip bounds how far one update moves toward a reply the
policy did not sample on that prompt (`NEXTSTATE_ACCEPTED_AFTER_CORRECTION` turns it off).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from nextstate.core.types import Sample
from nextstate.judge.advantages import token_advantages

if TYPE_CHECKING:
    from nextstate.judge.service import Judge

log = logging.getLogger(__name__)

REASON = "accepted after a correction"


def corrected_pairs(samples: list[Sample]) -> list[tuple[Sample, Sample]]:
    """(corrected, accepted) pairs among one session's samples: consecutive turns whose own
    verdicts (the judge's or the person's) were negative, then positive, where the corrected
    turn has no sample built from its successor yet."""
    own = {s.turn_index: s for s in samples if s.accepted_from is None and s.track == "personal"}
    done = {s.turn_index for s in samples if s.accepted_from is not None}
    pairs = []
    for index, corrected in sorted(own.items()):
        accepted = own.get(index + 1)
        if accepted is None or index in done or not corrected.prompt_ids:
            continue
        if corrected.reward < 0 < accepted.reward and accepted.status != "dropped":
            pairs.append((corrected, accepted))
    return pairs


def accepted_weight(mode: str, w_binary: float) -> float:
    """The accepted reply's reward weighs as a reward in combined mode; in binary and in opd
    mode it is the one signal of its sample, and weighs 1."""
    return w_binary if mode == "combined" else 1.0


async def learn_from_accepted(judge: Judge, verdict: Sample) -> list[Sample]:
    """A turn got its verdict (`verdict`, stored): store the accepted reply as a sample of the
    turn it corrected, if this verdict completes such a pair, as the corrected or as the
    accepted turn (the two are judged in either order). Any failure costs this sample only."""
    settings = judge.settings
    if not settings.accepted_after_correction or verdict.accepted_from is not None or verdict.track != "personal":
        return []
    stored = []
    try:
        nearby = await asyncio.to_thread(judge.store.turn_samples, verdict.user, verdict.session_id,
                                         verdict.turn_index - 1, verdict.turn_index + 1)
        for corrected, accepted in corrected_pairs(nearby):
            await judge.quiet()
            scores = await judge.score_under_policy(accepted.user, accepted.adapter, corrected.prompt_ids,
                                                    accepted.response_ids, accepted.logprob_temperature)
            n = len(accepted.response_ids)
            weight = accepted_weight(settings.mode, settings.w_binary)
            sample = accepted.model_copy(update={
                "id": None, "turn_index": corrected.turn_index, "accepted_from": accepted.turn_index,
                "mode": settings.mode, "status": "ready", "tries": 0, "response_id": None, "feedback": None,
                "reason": f"{REASON}: the reply of turn {accepted.turn_index} on this turn's prompt",
                "prompt_ids": corrected.prompt_ids, "old_logprobs": scores, "votes": [], "hint": None,
                "teacher_logprobs": None, "teacher_prompt_ids": None, "contrast_prompt_ids": None, "distill_weight": None,
                "outcome": None,
                "advantages": token_advantages(n, accepted.reward, None, weight, 0.0), "loss_mask": [1] * n,
                "reward_weight": weight,
                "created_at": time.time(),
            })
            added = await judge.durable_write(judge.store.add_accepted_sample, sample)
            if added is None:  # built meanwhile from the other turn's verdict
                continue
            judge.notify(added)
            judge.records.write(
                "accepted_reply",
                {"sample_id": added.id, "user": added.user, "session_id": added.session_id,
                 "turn_index": added.turn_index, "mode": added.mode, "track": added.track, "status": added.status,
                 "reason": added.reason, "reward": added.reward, "accepted_from": added.accepted_from},
                version=added.policy_version,
            )
            stored.append(added)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - an extra sample: its failure never costs the verdict it came from
        log.exception("could not build the sample of a reply accepted after a correction")
    return stored
