"""The publish gate: a new version serves only if it is no worse on what can be checked cheaply.

An update can make a model worse in ways its own batch does not show: binary RL on SmolLM2
learned the user's preference and, on the way, degenerated into repetition ("The most, most,
most.", BENCHMARKS.md) — and every such version served. So before a version is published it
is scored on recent samples of its scope that it did not train on:

* **likelihood**: the mean per-token log-probability of the held-out replies that were
  rewarded (reward > 0) must not fall by more than `gate_max_likelihood_drop` nats from the
  serving version's: what users liked stays likely;
* **repetition**: greedy replies to recent prompts must not repeat themselves (the share of
  their token trigrams that repeat an earlier trigram of the same reply) more than
  `gate_max_repetition_rise` above the base model's replies to the same prompts. Trigrams, not
  single tokens: ordinary text repeats "the" and "," all the time but rarely three tokens in a
  row, degenerate text ("most, most, most") does little else — a first try counting single
  tokens held back every update of the SmolLM2 bench on noise (base 0.15-0.18). The anchor is the base model, not the serving
  version, so that small rises cannot pile up version after version.

A version that fails is tried again at half its step (`gate_backtracks` times, as a line search
backtracks): an update in a good direction that went too far keeps part of what it learned
instead of none, and the held-back samples are not wasted whole. One that still fails is
recorded with its figures, does not serve, and the learner's weights go back to the serving
version (training goes on from the last good one). With too few held-out samples a check is
skipped and says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MIN_HELD_OUT = 2


@dataclass
class GateFigures:
    """What one version scores on the held-out samples."""

    liked_logprob: float | None  # mean per-token logprob of held-out rewarded replies
    repetition: float | None  # mean share of repeated trigrams in greedy replies (not measured for the serving version)


@dataclass
class GateVerdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    serving: GateFigures | None = None
    candidate: GateFigures | None = None
    base_repetition: float | None = None
    held_out: int = 0
    prompts: int = 0
    seconds: float = 0.0  # what scoring the candidate cost (the serving version's figures come before the step)
    step_scale: float = 1.0  # the share of the trained step these figures are of (after backtracking)
    refused: list[list[str]] = field(default_factory=list)  # the reasons of each longer step that failed first

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def repetition(token_ids: list[int]) -> float | None:
    """Share of the reply's token trigrams that repeat an earlier one (None under 6 tokens)."""
    if len(token_ids) < 6:
        return None
    trigrams = [tuple(token_ids[i : i + 3]) for i in range(len(token_ids) - 2)]
    return 1 - len(set(trigrams)) / len(trigrams)


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def judge_version(
    serving: GateFigures, candidate: GateFigures, base_repetition: float | None, *,
    max_likelihood_drop: float, max_repetition_rise: float, held_out: int, prompts: int,
) -> GateVerdict:
    reasons = []
    if serving.liked_logprob is not None and candidate.liked_logprob is not None:
        drop = serving.liked_logprob - candidate.liked_logprob
        if drop > max_likelihood_drop:
            reasons.append(f"rewarded replies became less likely: {drop:.3f} nats/token (limit {max_likelihood_drop:g})")
    if base_repetition is not None and candidate.repetition is not None:
        rise = candidate.repetition - base_repetition
        if rise > max_repetition_rise:
            reasons.append(f"greedy replies repeat themselves: {candidate.repetition:.3f} against the base model's "
                           f"{base_repetition:.3f} (limit +{max_repetition_rise:g})")
    return GateVerdict(not reasons, reasons, serving, candidate, base_repetition, held_out, prompts)
