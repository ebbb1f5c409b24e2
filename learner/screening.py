"""Which samples must not train, and why — every reason in one place.

A sample is screened twice: when it is ready (`drop_reason`, before it can take a batch slot)
and once its batch has its final advantages (outcome samples get theirs only then, standardised
over the batch): then a sample with a non-finite value is left out alone (`finite`), and the
batch is dropped whole when nothing in it could teach (`batch_teaches`).
Each dropped sample keeps its reason in the store, which `nextstate status` counts.
"""

from __future__ import annotations

import math

from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample

NOT_FINITE = "not finite: dropped by the learner"
NO_SIGNAL = "no signal: advantage 0, no teacher to distil and no KL term"
NO_SIGNAL_IN_BATCH = "no signal: every advantage of its batch is zero, no teacher to distil and no KL term"
TOO_LONG = "response longer than NEXTSTATE_MAX_TRAIN_TOKENS"


def teaches(sample: Sample) -> bool:
    """A non-zero advantage, or a teacher to distil (NEXTSTATE_OPD_LOSS=topk: a hindsight hint's
    sample has no reward, so every advantage is 0, and all it teaches is in its distillation)."""
    return any(sample.advantages) or bool(sample.distill_weight)


def finite(sample: Sample) -> bool:
    return all(map(math.isfinite, sample.advantages)) and all(map(math.isfinite, sample.old_logprobs))


def drop_reason(sample: Sample, settings: LearnerSettings, behind: int) -> str | None:
    """Why a ready `sample` must not take a batch slot, or None. `behind`: versions its scope
    has published since the one that served it. A sample that teaches nothing would only dilute
    the token mean (the at-least-one rule's neutral samples); outcome samples
    are judged by their advantages once their batch gives them theirs. Non-finite values are
    looked for in the batch (`finite`), where the rest of the batch then trains without them."""
    if sample.track != "outcome" and not teaches(sample):
        return NO_SIGNAL
    if len(sample.response_ids) >= settings.max_train_tokens:
        return TOO_LONG
    if settings.max_staleness and behind > settings.max_staleness:
        return f"stale: served by a version more than {settings.max_staleness} behind (NEXTSTATE_MAX_STALENESS)"
    return None


def batch_teaches(batch: list[Sample]) -> bool:
    """Whether a step on `batch` would learn anything: with nothing that teaches it would only
    move the weights by momentum and weight decay (an outcome batch whose rewards were all equal
    says nothing, standardised)."""
    return any(teaches(x) for x in batch)
