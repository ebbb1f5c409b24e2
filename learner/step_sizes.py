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
the SmolLM2 steps that overshoot (BENCHMARKS.md, "No rating lost").

Each scope also remembers where its next step starts (Ziegler et al. 2019 adapt their KL
coefficient to the KL measured on earlier steps; here it is the step's length that adapts): a
step that had to be shortened makes the next start no longer than `GROWTH` times the length
kept, and one not published at all (the floor overshot, or the publish gate refused every
length) makes the next start below the shortest length tried, so the same samples, tried
again, are not refused the same way twice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TARGET_SHARE = 0.8
MIN_SHRINK, MAX_SHRINK = 0.25, 0.7
GROWTH = 2.0


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

    def settle(self, scope: str, scale: float, published: bool) -> None:
        """Where the scope's next step starts: `scale` is the length this step served at when
        `published`, else the shortest length it tried."""
        if published:
            start = min(1.0, scale * GROWTH)
        else:  # below everything this step tried: its samples come back and must not fail alike
            start = scale * (self.shrink or MIN_SHRINK)
        if start >= 1.0:
            self._start.pop(scope, None)
        else:
            self._start[scope] = start

    def forget(self, scope: str) -> None:
        self._start.pop(scope, None)
