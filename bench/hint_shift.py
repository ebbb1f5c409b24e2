"""Which way the hint points: the shift the OPD target distils, per preference kind.

The default distillation target is the policy moved by what the hint changes in the base model
(NEXTSTATE_OPD_TARGET=shift, learner/distillation.py): log π_θ + log π_base(·|hint) −
log π_base(·|no hint). What the hinted model *writes* (bench.teacher_ceiling's "told" share)
is then not the limit of what it can teach: each update applies the hint's ratio again to a
policy the earlier ones already moved, so a direction the hint points in consistently compounds
— the opening word was learnt to 0.97 where its hinted teacher writes it 0.60 of the time, the
length wish to 0.93 where it writes 0.39. The figure that says whether a kind can be learnt is
therefore the direction: at the positions of the base model's own replies where the kind's
choice is live, how far the hint moves the log-odds of the tokens that fit the wish against
those that do not. A kind whose hinted replies almost never fit (lowercase, a bulleted list) may
still have a direction to compound.

Token classes per kind (a token "fits" by its text):
  opening  the first position; tokens that begin the marker word.
  length   after a sentence's end (".", "!", "?"); the end-of-turn tokens against the rest.
  format   the first position and each one after a line break; tokens that begin a "-" item.
  case     where the base model puts over 10% on a token with a capital letter; tokens with
           lowercase letters and no capital against tokens with a capital.
The topic kind has no token class (a word to avoid is spelt by many tokens).

Where a wish belongs at one place, the same tokens' shift at the places it does not is the
spill (`spill_of`): the opening word's "The" at the start of every later line and sentence.
The shift target compounds a spill as it compounds the wish; a version of the opening word's
hard seed served replies whose every line began "The" (BENCHMARKS.md, twelfth pass).

Why the hint moves a token is not asked: part of it is plainly the hinted prompt holding the
token ("- " in the list instruction; even the random tiny test model shows a shift towards it).
For the learner that does not matter — it compounds whatever the ratio says — but it is why a
positive direction is a reason to run the kind, not a promise that it will be learnt.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from nextstate.learner.distillation import log1mexp

# A position counts for the case kind where the base model gives capitals at least this mass.
LIVE_CAPITALS = 0.1


@dataclass(frozen=True)
class TokenClass:
    """Which tokens fit the wish (`good`), which go against it (`bad`, the rest when None), and
    at which reply positions the choice is live."""

    good: torch.Tensor  # [vocab] bool
    bad: torch.Tensor | None
    live: str  # "first", "after_sentence", "line_starts", "later_starts", "capitals"


def token_class(kind: str, vocab: list[str], end_ids: list[int], marker: str = "The") -> TokenClass | None:
    """The kind's token class over `vocab` (each token id's text), or None for a kind without one."""
    if kind == "opening":
        begins = [bool(t := v.strip()) and (t.startswith(marker) or marker.startswith(t)) for v in vocab]
        return TokenClass(torch.tensor(begins), None, "first")
    if kind == "length":
        return TokenClass(torch.isin(torch.arange(len(vocab)), torch.tensor(end_ids)), None, "after_sentence")
    if kind == "format":
        return TokenClass(torch.tensor([v.lstrip().startswith("-") for v in vocab]), None, "line_starts")
    if kind == "case":
        capital = torch.tensor([any(c.isupper() for c in v) for v in vocab])
        lower = torch.tensor([any(c.islower() for c in v) for v in vocab]) & ~capital
        return TokenClass(lower, capital, "capitals")
    return None


def spill_of(cls: TokenClass) -> TokenClass | None:
    """A first-position wish's tokens at the start of every later line and sentence (None for
    a kind whose choice is live all through the reply)."""
    return TokenClass(cls.good, cls.bad, "later_starts") if cls.live == "first" else None


def live_positions(cls: TokenClass, reply_texts: list[str], asked: torch.Tensor) -> torch.Tensor:
    """[n] bool: the reply positions where the kind's choice is live. `reply_texts[i]` is the
    text of the reply's tokens before position i; `asked` the base model's log-probabilities."""
    n = asked.shape[0]
    sentence_ended = [text.rstrip().endswith((".", "!", "?")) for text in reply_texts[:n]]
    line_broken = [text.endswith("\n") for text in reply_texts[:n]]
    if cls.live == "first":
        return torch.arange(n) == 0
    if cls.live == "after_sentence":
        return torch.tensor([i > 0 and sentence_ended[i] for i in range(n)])
    if cls.live == "line_starts":
        return torch.tensor([i == 0 or line_broken[i] for i in range(n)])
    if cls.live == "later_starts":
        return torch.tensor([i > 0 and (line_broken[i] or sentence_ended[i]) for i in range(n)])
    assert cls.bad is not None, "the capitals' class names its bad tokens"
    return class_logmass(asked, cls.bad).exp() > LIVE_CAPITALS


def class_logmass(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n] log of the mass on `mask`'s tokens (a model may pad its logits past the tokenizer's ids)."""
    return torch.logsumexp(logprobs[:, :mask.numel()][:, mask], dim=-1)


def log_odds(logprobs: torch.Tensor, cls: TokenClass) -> torch.Tensor:
    """[n] log-odds of the fitting tokens against the others (or the `bad` class) at each position."""
    good = class_logmass(logprobs, cls.good)
    if cls.bad is not None:
        return good - class_logmass(logprobs, cls.bad)
    return good - log1mexp(good)


def shift_at(cls: TokenClass, asked: torch.Tensor, hinted: torch.Tensor, prefixes: list[str]) -> list[float]:
    """The hint's log-odds shift towards the wish at each live position of one reply."""
    live = live_positions(cls, prefixes, asked)
    return (log_odds(hinted, cls) - log_odds(asked, cls))[live].tolist()


def summary(shifts: list[float], first_masses: list[tuple[float, float]]) -> dict:
    """Mean, median and share pointing the wish's way, over every live position of every reply;
    and the first position's mass on fitting tokens, asked → hinted (mean over replies)."""
    if not shifts:
        return {"positions": 0}
    return {
        "positions": len(shifts),
        "mean": round(statistics.fmean(shifts), 3),
        "median": round(statistics.median(shifts), 3),
        "towards": round(sum(s > 0 for s in shifts) / len(shifts), 3),
        "first_mass_asked": round(statistics.fmean(a for a, _ in first_masses), 4),
        "first_mass_hinted": round(statistics.fmean(h for _, h in first_masses), 4),
    }


def reply_logprobs(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """[len(reply), vocab] the model's next-token log-probabilities at each reply position."""
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def reply_shift(model, tokenizer, cls: TokenClass, asked_prompt: list[int], hinted_prompt: list[int],
                reply: list[int]) -> tuple[list[float], tuple[float, float]]:
    """One reply's shifts at its live positions, and the first position's fitting mass asked, hinted."""
    asked = reply_logprobs(model, asked_prompt, reply)
    hinted = reply_logprobs(model, hinted_prompt, reply)
    prefixes = [tokenizer.decode(reply[:i]) for i in range(len(reply))]
    first = (float(class_logmass(asked[:1], cls.good).exp()), float(class_logmass(hinted[:1], cls.good).exp()))
    return shift_at(cls, asked, hinted, prefixes), first
