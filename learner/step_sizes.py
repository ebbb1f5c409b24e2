"""How long a scope's update may be: the KL line search and the length a step starts at.

An update is trained at full length and measured: the policy KL between the weights before
the update and after it, on the batch's tokens (learner/trainer.py). One that moves the policy
further than `max_kl` used to be undone whole, and its samples thrown away with it — four
ratings on SmolLM2 at the defaults made a first step of KL 1.28 against a limit of 1, and a
person's ratings were lost for good (issue 38). Now the step is shortened along its own
direction and measured again, as TRPO's backtracking line search does, until it fits or
`kl_backtracks` shortenings have been tried.

How much shorter: near its start, KL grows as the square of a step's length (it is a
divergence: zero with a zero gradient at length 0), so a step of length s and KL k fits a
target t at about s·√(t/k). The next length is that, aimed at `TARGET_SHARE` of the limit so
noise does not bounce it back over, and kept between `MIN_SHRINK` and `MAX_SHRINK` of the
length before (the model is only local: a length far from where it was measured is not
trusted). Plain halving (TRPO's) is the alternative; bench/kl_backtracking.py measured both on
the SmolLM2 steps that overshoot (docs/benchmark-log.md, "No rating lost").

Each scope also remembers where its next step starts (Ziegler et al. 2019 adapt their KL
coefficient to the KL measured on earlier steps; here it is the step's length that adapts). A
published step of length s and KL k makes the next start s·√(TARGET_SHARE·max_kl/k) — the same
quadratic model, read forwards — kept between `GROWTH` and `MAX_GROWTH` times s. At least
doubling, because starting too long costs one more forward pass (the line search shortens it
within the step) while starting too short costs a whole update that moves nothing; at most
`MAX_GROWTH`, because one batch's KL says little about the next one's (0.15-0.99 at full
length across the length bench's steps). Plain doubling was the rule before: after a refusal
the start fell to 1/64-1/8 of a step and took 3-5 published updates to come back, each
training its samples at a policy KL of 0.0001-0.02 against a median of 0.35 for full steps —
ratings consumed, nothing learnt; on the length bench with the sensible user this rule scores
0.40 ± 0.01 where doubling scored 0.18 and 0.16 on the same seeds (docs/benchmark-log.md, "Step lengths
after a refusal").

A step not published at all (the floor overshot, or the publish gate refused every length)
makes the next start shorter than the shortest length tried, `MIN_SHRINK` of it, so the same
samples, tried again, are not refused the same way twice — but not shorter than where the
model puts its KL at `FLOOR_SHARE` of the limit: a gate that refused a step of KL 0.003 did
not refuse it for its length (a greedy reply flipped on a near-tie, or the serving version had
already spent the forgetting budget), and a step shorter still would teach nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TARGET_SHARE = 0.8
MIN_SHRINK, MAX_SHRINK = 0.25, 0.7
GROWTH, MAX_GROWTH = 2.0, 8.0
FLOOR_SHARE = 0.01


@dataclass(frozen=True)
class KlTry:
    """One length of a step and the policy KL measured at it."""

    scale: float  # share of the trained step
    kl: float

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}


class StepSizes:
    """Per scope: the length its next step starts at, and the lengths its line search tries.
    `shrink` fixes each shortening's factor (0.5: plain halving) instead of the quadratic rule."""

    def __init__(self, max_kl: float, backtracks: int, shrink: float | None = None) -> None:
        self.max_kl = max_kl
        self.backtracks = backtracks
        self.shrink = shrink
        self._start: dict[str, float] = {}

    def start(self, scope: str) -> float:
        return self._start.get(scope, 1.0)

    def next_scale(self, tries: list[KlTry]) -> float | None:
        """The next, shorter length to try after `tries` (the last one measured last), or None
        when the last fits, is not finite (nothing to shorten: the step is undone), or the
        line search has tried its `backtracks` shortenings."""
        last = tries[-1]
        if not math.isfinite(last.kl) or last.kl <= self.max_kl or len(tries) > self.backtracks:
            return None
        if self.shrink is not None:
            return last.scale * self.shrink
        factor = math.sqrt(TARGET_SHARE * self.max_kl / last.kl)
        return last.scale * min(MAX_SHRINK, max(MIN_SHRINK, factor))

    def settle(self, scope: str, scale: float, kl: float, published: bool) -> None:
        """Where the scope's next step starts: `scale` is the length this step served at when
        `published`, else the shortest length it tried; `kl` the policy KL at that length."""
        if published:
            growth = self._fit(kl, TARGET_SHARE)
            start = scale * min(MAX_GROWTH, max(GROWTH, growth))
        else:  # shorter than it tried: its samples come back and must not fail alike
            start = scale * max(self.shrink or MIN_SHRINK, min(1.0, self._fit(kl, FLOOR_SHARE)))
        if start >= 1.0:
            self._start.pop(scope, None)
        else:
            self._start[scope] = start

    def _fit(self, kl: float, share: float) -> float:
        """By the quadratic model, the factor on a length of KL `kl` that makes its KL `share`
        of the limit (0 when the KL was not finite: nothing is known but that it went wrong)."""
        if not math.isfinite(kl):
            return 0.0
        return math.sqrt(share * self.max_kl / kl) if kl > 0 else math.inf

    def forget(self, scope: str) -> None:
        self._start.pop(scope, None)
