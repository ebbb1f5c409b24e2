"""Which samples must not train, and why — every reason in one place, one screen.

A sample passes the same screen twice: when it is ready (before it can take a batch slot) and
once its batch has its final advantages (outcome samples get theirs only then, standardised
over the batch). The second time the batch is also dropped whole when nothing left in it could
teach. Each dropped sample keeps its reason in the store, which `nextstate status` counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

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


def drop_reason(sample: Sample, settings: LearnerSettings, behind: int, batch: bool = False) -> str | None:
    """Why `sample` must not train, or None. `behind`: versions its scope has published since
    the one that served it. A sample that teaches nothing would only dilute the token mean (the
    at-least-one rule's neutral samples); outcome samples are judged by their advantages once
    their batch gives them theirs. Non-finite values are looked for in the `batch`, which then
    trains on without them (a ready sample keeps its slot until then)."""
    if batch and not finite(sample):
        return NOT_FINITE
    if sample.track != "outcome" and not teaches(sample):
        return NO_SIGNAL
    if len(sample.response_ids) >= settings.max_train_tokens:
        return TOO_LONG
    if settings.max_staleness and behind > settings.max_staleness:
        return f"stale: served by a version more than {settings.max_staleness} behind (NEXTSTATE_MAX_STALENESS)"
    return None


@dataclass
class Screened:
    kept: list[Sample]  # in the order given
    dropped: dict[str, list[int]] = field(default_factory=dict)  # reason -> sample ids

    def ids(self, *but: str) -> list[int]:
        return [i for why, ids in self.dropped.items() if why not in but for i in ids]


def screen(samples: list[Sample], settings: LearnerSettings, behind: Callable[[Sample], int],
           batch: bool = False) -> Screened:
    """`samples` split into those that may train and those that may not, by reason. `batch`:
    they are one batch with its final advantages, dropped whole when nothing left in it
    teaches (a step would only move the weights by momentum and weight decay; an outcome batch
    whose rewards were all equal says nothing, standardised)."""
    screened = Screened([])
    for sample in samples:
        if sample.id is not None and (why := drop_reason(sample, settings, behind(sample), batch)) is not None:
            screened.dropped.setdefault(why, []).append(sample.id)
        else:
            screened.kept.append(sample)
    if batch and not any(teaches(x) for x in screened.kept):
        screened.dropped[NO_SIGNAL_IN_BATCH] = [x.id for x in screened.kept if x.id is not None]
        screened.kept = []
    return screened
