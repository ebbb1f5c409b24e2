"""Per-token advantages for each mode, and the per-batch standardisation of outcome samples.

binary:    A_t = r                                    (r = majority vote ∈ {+1, 0, -1})
opd:       A_t = clip(logπ_teacher(a_t) − logπ_old(a_t), ±c)
combined:  A_t = w_binary · r + w_opd · clip(teacher − old, ±c)      (OPD term only with a hint)
outcome:   R = o + mean(votes); A = (R − mean_k) / std_k over the batch's samples with the
           same step index k (paper §4.4.2), plus the OPD term when there is one.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from nextstate.core.settings import JudgeSettings
from nextstate.core.types import Sample


def step_reward(outcome: float, votes: list[int | None]) -> float:
    """o + Σ r_i / m (paper §4.4.2); a failed vote counts as 0."""
    return outcome + (sum(v or 0 for v in votes) / len(votes) if votes else 0.0)


def with_outcome(sample: Sample, outcome: float) -> Sample | None:
    """The sample once its session's outcome is known: an outcome-track sample whose reward
    is o + mean(votes), ready to train. None for a sample that has no step reward to add o to
    (an OPD-only sample, judged without PRM votes); an episode's last step, which had no next
    state to vote on and waits for the outcome as its next state, gets o itself."""
    if not sample.votes and sample.status != "awaiting_outcome":
        return None
    return sample.model_copy(
        update={
            "status": "ready",
            "track": "outcome",
            "outcome": outcome,
            "reward": step_reward(outcome, sample.votes),
            "reason": "outcome + mean votes",
        }
    )


def opd_delta(teacher: list[float], old: list[float], clip: float) -> list[float]:
    if len(teacher) != len(old):
        raise ValueError(f"teacher has {len(teacher)} logprobs, the response {len(old)}")
    return [max(-clip, min(clip, t - o)) for t, o in zip(teacher, old)]


def token_advantages(
    n_tokens: int,
    reward: float | None,
    delta: list[float] | None,
    w_binary: float,
    w_opd: float,
) -> list[float]:
    scalar = w_binary * reward if reward is not None else 0.0
    if delta is None:
        return [scalar] * n_tokens
    return [scalar + w_opd * d for d in delta]


def standardize_outcome_batch(samples: list[Sample], w_binary: float, w_opd: float, clip: float) -> list[Sample]:
    """Give each outcome sample of a training batch its advantages.

    Samples of other tracks pass through unchanged. A step index with a single sample in the
    batch keeps its raw reward: standardising a group of one would zero it (a bug seen in a
    derivative of the reference code).
    """
    groups: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        if s.track == "outcome":
            groups[s.turn_index].append(s.reward)
    out = []
    for s in samples:
        if s.track != "outcome":
            out.append(s)
            continue
        rewards = groups[s.turn_index]
        if len(rewards) > 1:
            std = statistics.pstdev(rewards)
            scalar = (s.reward - statistics.fmean(rewards)) / (std + 1e-6)
        else:
            scalar = s.reward
        delta = opd_delta(s.teacher_logprobs, s.old_logprobs, clip) if s.teacher_logprobs else None
        out.append(s.model_copy(update={"advantages": token_advantages(len(s.response_ids), scalar, delta, w_binary, w_opd)}))
    return out


def prepare_batch(samples: list[Sample], settings: JudgeSettings) -> list[Sample]:
    """The advantages a training batch trains on: outcome rewards are standardised per step
    index across the batch, here at batch time, because only then is the group known."""
    return standardize_outcome_batch(samples, settings.w_binary, settings.w_opd, settings.opd_clip)
