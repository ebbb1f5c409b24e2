"""The publish gate: a new version serves only if it is no worse on what can be checked cheaply.

An update can make a model worse in ways its own batch does not show: binary RL on SmolLM2
learned the user's preference and, on the way, degenerated into repetition ("The most, most,
most.") — and every such version served. So before a version is published it is scored on
recent samples of its scope that it did not train on (the readings: learner/readings.py):

* **worse for its user**: its gain on the user's held-out turns (learner/held_out.py) may not
  fall more than `gate_max_gain_drop` below the serving version's, turn by turn, past two
  standard errors;
* **forgetting**: its perplexity on the shipped general-text probe may not rise more than
  `gate_max_forgetting` over the base model's (read a part at a time, until the passages read
  put it clearly inside the limit: learner/readings.py `_probe_nll`);
* **likelihood**: the mean per-token log-probability of the held-out replies that were
  rewarded may not fall by more than `gate_max_likelihood_drop` nats from the serving
  version's: what users liked stays likely;
* **repetition**: replies to recent prompts may not repeat their words (the share of the first
  REPETITION_WORDS words that repeat an earlier one) more than `gate_max_repetition_rise` above
  the base model's replies to the same prompts. Words, not token trigrams: trigrams caught loops
  but not a wish spread past its place (every line beginning "The");
* **empty replies**: the chance that a reply ends at its first token may not exceed the base
  model's by more than `gate_max_empty_rise`: a wish for shorter replies, taught step after
  step, slides into no reply at all.

The reply checks are anchored at the base model, so that small rises cannot pile up version
after version, and a version no worse than the one serving is not refused for them (refusing
everything near a serving version already past the limit held every later update back). The
replies are two per prompt sampled at temperature 1, the candidate's and the base model's from
the same seeded draws (common random numbers): what a client at the API's default temperature is
served; greedy replies loop on near-ties a sampler passes over, and such flips were most of a
greedy gate's refusals (docs/benchmark-log.md, "Decided levers"). The prompts are the scope's
recent ones, then its held-out turns', then the batch's own, topped up to eight from everyday
questions shipped with the package.

A version that fails is tried again at half its step (`gate_backtracks` times, as a line search
backtracks): an update in a good direction that went too far keeps part of what it learned.
One that still fails does not serve, and the learner's weights go back to the serving version;
its samples wait, ready, and are tried again later from a shorter step (learner/service.py,
learner/step_sizes.py). With too few held-out samples a check is skipped and says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from nextstate.core.stores.samples import SampleStore
from nextstate.core.settings import LearnerSettings
from nextstate.core.types import Sample
from nextstate.engine.prefix_cache import common_prefix
from nextstate.learner.held_out import MIN_GAIN_TURNS, MIN_HELD_OUT

if TYPE_CHECKING:  # the readings load torch; the gate's verdicts do not need it
    from nextstate.learner.readings import GateFigures, Readings

log = logging.getLogger(__name__)

# The held-out set: the newest accepted samples of the scope outside the batch, the rewarded
# ones among them for likelihood, the newest prompts answered. Eight prompts, not four: one
# reply that happens to loop moves a mean of four by a quarter of its repetition.
GATE_SAMPLES, GATE_LIKED, GATE_PROMPTS, GATE_NEW_TOKENS = 24, 8, 8, 32
# The gate's replies read their prompts whole where all of them cost no more than eight prompts
# of this many tokens beyond what they share (one agent's turns share its setup and conversation:
# four OpenClaw prompts of 3.8-4.5k tokens are 4.5k tokens read), else the last this many tokens
# of each. An agent's prompts are 5-8k tokens (OpenClaw), and on a CPU prefilling eight of them
# apart is most of a check: six OpenClaw prompts of 5.4-7k tokens took 647 s to answer whole and
# 129 s cut to their last 2048 tokens (SmolLM2, two busy cores). Candidate and base read the
# same prompts, so the comparison stays paired.
GATE_PROMPT_TOKENS = 2048
# Each backtrack of a version the gate refused keeps this share of the step tried before.
BACKTRACK_FACTOR = 0.5
# A version is worse for its user only if its gain fell past the limit by more than this many
# standard errors of the per-turn differences (a one-sided test at about 97.5%): on the two to
# eight held-out turns a new user has, one reply's swing refused a first update of the opening-word
# bench (-0.09 on 2 turns), and the steps after it restarted at an eighth of their length.
GAIN_DROP_ERRORS = 2.0


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
    base_empty: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gate_prompts(candidates: list[list[int]]) -> list[list[int]]:
    """The first GATE_PROMPTS distinct non-empty prompts (a reply to the same prompt twice tells
    nothing new): whole, where reading them all costs no more than GATE_PROMPTS prompts of
    GATE_PROMPT_TOKENS beyond what they share (the trainer reads each from what an earlier one
    shares with it), else each its last GATE_PROMPT_TOKENS."""
    whole = _distinct(candidates)
    if _read_tokens(whole) <= GATE_PROMPTS * GATE_PROMPT_TOKENS:
        return whole
    return _distinct([ids[-GATE_PROMPT_TOKENS:] for ids in candidates])


def _distinct(candidates: list[list[int]]) -> list[list[int]]:
    seen, out = set(), []
    for ids in candidates:
        key = tuple(ids)
        if ids and key not in seen:
            seen.add(key)
            out.append(ids)
    return out[:GATE_PROMPTS]


def _read_tokens(prompts: list[list[int]]) -> int:
    """Tokens a read of `prompts` computes when each (shortest first) starts from the longest
    prefix it shares with one read before it."""
    done: list[list[int]] = []
    total = 0
    for ids in sorted(prompts, key=len):
        total += len(ids) - max((common_prefix(ids, d) for d in done), default=0)
        done.append(ids)
    return total


def rose_past(now: float | None, serving: float | None, base: float | None, limit: float | None) -> bool:
    """The rule of both reply checks (repetition, empty replies): `now` exceeds the base model's
    figure by more than `limit` — anchored at the base so small rises cannot pile up version
    after version — and is worse than the serving version's (a version no worse than the one
    serving is not held back for it). False where a figure is missing."""
    if now is None or base is None or limit is None:
        return False
    return now - base > limit and not (serving is not None and now <= serving)


def verdict_from_figures(
    serving: GateFigures, candidate: GateFigures, base_repetition: float | None, *,
    max_likelihood_drop: float, max_repetition_rise: float, held_out: int, prompts: int,
    max_gain_drop: float | None = None, max_forgetting: float | None = None,
    base_empty: float | None = None, max_empty_rise: float | None = None,
) -> GateVerdict:
    reasons = []
    now, was = candidate.version, serving.version
    if (max_gain_drop is not None and now is not None and was is not None and now.gain is not None
            and was.gain is not None and now.held_out >= MIN_GAIN_TURNS):
        paired = now.drop_from(was)
        drop, error = paired if paired is not None else (was.gain - now.gain, None)
        if drop > max_gain_drop and (error is None or drop > GAIN_DROP_ERRORS * error):
            reasons.append(f"worse for its user: gain on {now.held_out} held-out turns {now.gain:+.3f} against the "
                           f"serving version's {was.gain:+.3f} nats/token (limit -{max_gain_drop:g}"
                           + (f"; per turn {drop:.3f} ± {error:.3f})" if error is not None else ")"))
    if max_forgetting is not None and now is not None and now.forgetting is not None and now.forgetting > max_forgetting:
        reasons.append(f"forgets: perplexity on general text {now.forgetting:+.1%} over the base model's "
                       f"(limit +{max_forgetting:.0%})")
    if serving.liked_logprob is not None and candidate.liked_logprob is not None:
        drop = serving.liked_logprob - candidate.liked_logprob
        if drop > max_likelihood_drop:
            reasons.append(f"rewarded replies became less likely: {drop:.3f} nats/token (limit {max_likelihood_drop:g})")
    if rose_past(candidate.repetition, serving.repetition, base_repetition, max_repetition_rise):
        reasons.append(f"replies to recent prompts repeat themselves: {candidate.repetition:.3f} against the base model's "
                       f"{base_repetition:.3f} (limit +{max_repetition_rise:g})"
                       + (f" and the serving version's {serving.repetition:.3f}" if serving.repetition is not None else ""))
    if rose_past(candidate.empty, serving.empty, base_empty, max_empty_rise):
        reasons.append(f"replies end before they begin: {candidate.empty:.1%} of replies to recent prompts would be "
                       f"empty against the base model's {base_empty:.1%} (limit +{max_empty_rise:.0%})")
    return GateVerdict(not reasons, reasons, serving, candidate, base_repetition, held_out, prompts, base_empty=base_empty)


@dataclass
class HeldOut:
    """What a scope's next version is checked on, chosen (and the serving version scored on
    it) before the step, so that the step's own samples are never among it."""

    liked: list[Sample]  # rewarded replies, for likelihood (empty: too few to check)
    prompts: list[list[int]]  # prompt ids to answer, for repetition and empty replies
    serving: GateFigures
    turns: list[Sample] = field(default_factory=list)  # the scope's held-out turns (never trained on)


class PublishGate:
    """Decides whether a trained step may serve; shortens or undoes it when not. Runs in the
    learner's worker thread (every method blocks on the model)."""

    def __init__(self, settings: LearnerSettings, store: SampleStore, readings: Readings, per_user: bool) -> None:
        self.settings = settings
        self.store = store
        self.readings = readings
        self.trainer = readings.trainer
        self.per_user = per_user

    def hold_out(self, scope: str, batch: list[Sample]) -> HeldOut | None:
        """Recent samples of the scope not in the batch, with the serving version's figures on
        them (prompts topped up to eight, so there is always something to check). None
        when the gate is off."""
        if not self.settings.publish_gate:
            return None
        recent, turns, prompts = self._held_out(scope, batch)
        liked = [x for x in recent if x.reward > 0][:GATE_LIKED]
        liked = liked if len(liked) >= MIN_HELD_OUT else []
        serving = self.readings.gate_figures(scope, liked, prompts, GATE_NEW_TOKENS)
        serving.version = self.readings.version_figures(scope, turns, probe=False)  # only its gain is compared
        return HeldOut(liked, prompts, serving, turns)

    def _held_out(self, scope: str, batch: list[Sample]) -> tuple[list[Sample], list[Sample], list[list[int]]]:
        """The scope's recent samples outside `batch`, its held-out turns, and the gate's prompts."""
        recent = self.store.recent_samples(GATE_SAMPLES, scope if self.per_user else None, {x.id for x in batch})
        turns = self.held_out_turns(scope)
        prompts = gate_prompts([x.prompt_ids for x in recent + turns + batch])
        if len(prompts) < GATE_PROMPTS:  # a new scope: its two to four prompts would be noise
            prompts = gate_prompts(prompts + self.readings.everyday_prompts(GATE_PROMPTS))
        return recent, turns, prompts

    def read_ahead(self, scope: str, ready: list[Sample], stop: Callable[[], bool] = lambda: False) -> int:
        """The serving side of a new scope's first check, read while its batch fills: a scope
        still at the base model is scored by the base model's replies, which are kept per prompt
        (learner/readings.py), so after the last rating only the prompt that rating added is
        answered. On four OpenClaw turns the serving side took 15-25 s after the last rating, most
        of it on three prompts known before it. Then the base model's side of the forgetting
        probe, which the first check in a process read after the update (10 s of a 32-s check on
        four OpenClaw samples). A prompt, or a part of the probe, at a time, stopping once
        `stop()` (the learner closes, or a sample arrives that may fill the batch). Returns how
        many prompts were answered."""
        if not self.settings.publish_gate:
            return 0
        answered = self.readings.base_ahead(self._held_out(scope, ready)[2], GATE_NEW_TOKENS, stop) \
            if self.trainer._at_base(scope) else 0
        if not stop():  # the forgetting check's base side, read once in a process's life
            self.readings.base_probe_ahead(stop)
        return answered

    def held_out_turns(self, scope: str) -> list[Sample]:
        """The turns of the scope's users that no version trains on (one user's, per user)."""
        return self.store.held_out_samples(scope if self.per_user else None)

    def review(self, scope: str, held: HeldOut, step_index: int) -> GateVerdict:
        """The trained step's verdict. A failing step is tried again at a shorter length
        (`gate_backtracks` times); one that still fails is undone: training goes on from the
        serving version."""
        verdict = self._check(scope, held)
        for _ in range(self.settings.gate_backtracks if not verdict.passed else 0):
            # a step can overshoot in a good direction: half of it may learn without the harm
            self.trainer.shorten_step(scope, BACKTRACK_FACTOR)
            retry = self._check(scope, held)
            retry.step_scale = verdict.step_scale * BACKTRACK_FACTOR
            retry.refused = verdict.refused + [verdict.reasons]
            verdict = retry
            if verdict.passed:
                log.info("learner step %d (%s): the gate passed it at %g of its step (%s at more)",
                         step_index, scope, verdict.step_scale, "; ".join(verdict.refused[-1]))
                break
        if not verdict.passed:
            self.trainer.undo(scope)
        self.trainer.forget_reads()  # up to a GiB of prompts' keys and values, not read again soon
        return verdict

    def _check(self, scope: str, held: HeldOut) -> GateVerdict:
        started = time.monotonic()
        candidate = self.readings.gate_figures(scope, held.liked, held.prompts, GATE_NEW_TOKENS)
        candidate.version = self.readings.version_figures(scope, held.turns, max_forgetting=self.settings.gate_max_forgetting)
        base, base_empty = self.readings.base_figures(held.prompts, GATE_NEW_TOKENS) if held.prompts else (None, None)
        s = self.settings
        verdict = verdict_from_figures(
            held.serving, candidate, base, max_likelihood_drop=s.gate_max_likelihood_drop,
            max_repetition_rise=s.gate_max_repetition_rise, held_out=len(held.liked), prompts=len(held.prompts),
            max_gain_drop=s.gate_max_gain_drop, max_forgetting=s.gate_max_forgetting,
            base_empty=base_empty, max_empty_rise=s.gate_max_empty_rise,
        )
        verdict.seconds = round(time.monotonic() - started, 2)
        return verdict
