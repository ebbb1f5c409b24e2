"""What a version gained for its user, and what it forgot: the figures each version is scored on.

Every person's every-th judged or rated turn is held out — never trained on (NEXTSTATE_HELD_OUT_
EVERY, core/stores/samples.py's `HoldOut`) — with the evidence about it: the reply, its verdict
(accepted or rejected, by a rating or the judge), and the hint or correction where there was one.
Those turns are the truth a version is measured against, since no version saw them.

**gain** (nats per token): how far the version moved the held-out replies' likelihood the way the
person's reactions point, from where the version that wrote each reply had it:

    gain = Σ_i Σ_t A_i,t · (log π_v(a_i,t) − log π_wrote(a_i,t)) / Σ_i Σ_t |A_i,t|

A_i,t is the advantage the turn would have trained with (learner/ppo.py's): +r on every token of a
reply the person accepted, −r on one they rejected, plus the OPD teacher's token-level gap where a
hint or correction said what should change. So an accepted reply made likelier, a rejected one made
less likely, and the tokens the hinted teacher prefers made likelier all count up; the opposite
counts down. It is the quantity the learner's own loss pushes on, measured where it never trained.
The reference is the writer's own logprobs (kept with the turn), not the base model's: a reply is
likelier under the version that sampled it than under the base model just because that version
sampled it, so against the base model every rejected reply written by a trained version counted as
made likelier (measured: −0.2 on every version of a run whose replies were all rejected).

Beside it, its two halves, because the pooled gain can rise while the wish does not show (issue 40:
Pearson's r −0.30 between gain and measured success over 12 versions of the bench): a version that
flattens its distribution makes every rejected reply less likely and earns gain for it. So

**accepted** (nats per token): the mean rise of log π_v over log π_wrote on the tokens of held-out
replies the person accepted — the wish made likelier; and

**rejected** (nats per token): the mean fall on the tokens of the replies they rejected — what they
did not want made less likely.

Measured since (docs/benchmark-log.md, "The opening word learnt"): over 33 versions neither half tracked
the simulated user's success better than the pooled gain (r +0.13 and +0.05 against +0.24). A
scope's accepted held-out turns are few and mostly second attempts whose prompts carry the
person's correction, which says little about first replies; the halves are shown, not gated on.

**wish** (a share; 0 for the base model): on the held-out turns that came with a hint or a
correction, how far the version has gone, on the person's own prompt without the hint, the way
the hint moves the base model. At each response position, over the hinted base model's top K
tokens and one bin for the rest, S is the hint's move (log π_base(·|hint) − log π_base(·)) and D
the version's (log π_v(·) − log π_base(·)); the figure is the slope of D on S, weighted by the
hinted base's probabilities and pooled over positions:

    wish = Σ_t Σ_k w_k (D_k − D̄)(S_k − S̄) / Σ_t Σ_k w_k (S_k − S̄)²,   w = π_base(·|hint)

1 is a version that does untold what the base model does when told; above 1, further (the
`shift` distillation compounds). It asks the question the gain answers only indirectly — has the
version learnt what the person asked for, on turns it never saw — and needs no reply to have
been accepted. Only turns with a teacher's prompt count (NEXTSTATE_OPD_LOSS=topk or both).

**kl** (nats per token): k3 estimate of KL(π_v ‖ π_base) on the held-out replies' tokens — how far
the version is from the base model on this person's own prompts.

**forgetting** (a share; 0 for the base model): exp(NLL_v − NLL_base) − 1 on the general-text probe
shipped with the package (learner/probe/general_text.txt, 60 passages of plain text, about 200
sentences): how much more surprised the version is than the base model by ordinary text. 0.05 is a
perplexity 5% above the base model's.

Cheap by construction: one forward pass without gradients per held-out turn (its base-model
logprobs are computed once and kept) and one over the probe (~5,000 tokens) per version.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from nextstate.core.types import Sample

if TYPE_CHECKING:  # the gate and the status read the figures without loading torch
    import torch

# At least this many held-out samples before a check is made on them.
MIN_HELD_OUT = 2
# At least this many held-out turns before a version's gain is compared with another's: on
# fewer, one reply's swing is the whole difference.
MIN_GAIN_TURNS = 4


@dataclass
class VersionFigures:
    gain: float | None  # None: no held-out turn of the scope yet
    kl: float | None
    forgetting: float | None
    held_out: int  # turns scored
    accepted: float | None = None  # nats/token the accepted held-out replies became likelier (None: none held out)
    wish: float | None = None  # share of the hint's move made without the hint (None: no held-out turn with a hint)
    rejected: float | None = None  # nats/token the rejected ones became less likely
    turn_gains: list[float | None] = field(default_factory=list, repr=False)  # each turn's own gain, in order
    # each turn's (numerator, denominator) of the wish slope, in order; None for a turn without a hint
    turn_wishes: list[tuple[float, float] | None] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(self).items()
                if k not in ("turn_gains", "turn_wishes")}

    def drop_from(self, serving: VersionFigures) -> tuple[float, float | None] | None:
        """How much less this version gained than `serving` on the same held-out turns: the mean
        of the per-turn differences and its standard error (None under two turns), or None when
        they were not scored on the same turns. A gate compares these, not the two pooled
        gains: on a few turns one reply's swing is the whole difference."""
        if len(self.turn_gains) != len(serving.turn_gains) or not self.turn_gains:
            return None
        diffs = [was - now for now, was in zip(self.turn_gains, serving.turn_gains) if now is not None and was is not None]
        if not diffs:
            return None
        mean = sum(diffs) / len(diffs)
        if len(diffs) < 2:
            return mean, None
        variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        return mean, math.sqrt(variance / len(diffs))


@dataclass
class HintMove:
    """One held-out hinted turn's [response tokens, K] log-probabilities of the hinted base model's
    top K tokens: under the hinted base model, the unhinted base model and the version."""

    hinted: torch.Tensor
    unhinted: torch.Tensor
    version: torch.Tensor


def wish_terms(move: HintMove) -> tuple[float, float]:
    """The turn's numerator and denominator of the `wish` slope (module docstring)."""
    from nextstate.learner.distillation import with_tail

    hinted, unhinted, version = (with_tail(t) for t in (move.hinted, move.unhinted, move.version))
    w = hinted.exp()
    w = w / w.sum(-1, keepdim=True)
    shift, moved = hinted - unhinted, version - unhinted
    shift = shift - (w * shift).sum(-1, keepdim=True)
    moved = moved - (w * moved).sum(-1, keepdim=True)
    return float((w * moved * shift).sum()), float((w * shift * shift).sum())


def shipped_lines(name: str) -> list[str]:
    """A text shipped in learner/probe/: one item a line, comments (#) left out."""
    text = resources.files("nextstate.learner").joinpath(f"probe/{name}").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def probe_passages() -> list[str]:
    """The general-text probe, each passage read on its own. Passages of explanation and story,
    because a version that learnt short plain replies reads short plain sentences *better*: the
    one-line sentences this probe held before read −2.0% on such a version where the bench's
    held-out prose read +4.0% (2026-11-27, the length wish), and grouping those sentences eight
    at a time did not change it; it is the kind of text that matters, not the context's length."""
    return shipped_lines("general_text.txt")


def figures(samples: list[Sample], now: list[torch.Tensor], base: list[torch.Tensor],
            probe_nll: float | None, base_probe_nll: float | None,
            moves: list[HintMove | None] | None = None) -> VersionFigures:
    """The figures from the version's and the base model's logprobs of each held-out reply
    (`now`, `base`; the writer's are the sample's own), their mean NLL per token on the probe,
    and each hinted turn's distributions (`moves`)."""
    import torch

    from nextstate.learner.ppo import k3_kl

    weighted = weight = kl = tokens = 0.0
    turn_gains: list[float | None] = []
    rises = {True: [0.0, 0.0], False: [0.0, 0.0]}  # accepted or not: (summed rise, tokens)
    for sample, v, b in zip(samples, now, base):
        mask = torch.tensor(sample.loss_mask, dtype=torch.float32, device=v.device)
        advantages = torch.tensor(sample.advantages, dtype=torch.float32, device=v.device) * mask
        wrote = torch.tensor(sample.old_logprobs, dtype=torch.float32, device=v.device)
        turn_weighted, turn_weight = float((advantages * (v - wrote)).sum()), float(advantages.abs().sum())
        if sample.reward != 0:
            side = rises[sample.reward > 0]
            side[0] += float(((v - wrote) * mask).sum())
            side[1] += float(mask.sum())
        turn_gains.append(turn_weighted / turn_weight if turn_weight else None)
        weighted += turn_weighted
        weight += turn_weight
        kl += float((k3_kl(v, b) * mask).sum())
        tokens += float(mask.sum())
    forgetting = None
    if probe_nll is not None and base_probe_nll is not None:
        forgetting = math.exp(probe_nll - base_probe_nll) - 1
    turn_wishes = [wish_terms(m) if m is not None else None for m in (moves or [None] * len(samples))]
    terms = [t for t in turn_wishes if t is not None]
    spread = sum(d for _, d in terms)
    return VersionFigures(
        gain=weighted / weight if weight else None,
        kl=kl / tokens if tokens else None,
        forgetting=forgetting,
        held_out=len(samples),
        accepted=rises[True][0] / rises[True][1] if rises[True][1] else None,
        rejected=-rises[False][0] / rises[False][1] if rises[False][1] else None,
        turn_gains=turn_gains,
        turn_wishes=turn_wishes,
        wish=sum(n for n, _ in terms) / spread if spread > 0 else None,
    )
