"""Token selection from one step's logits, with the logprobs that training needs."""

from __future__ import annotations

import torch

from nextstate.engine.base import SamplingParams
from nextstate.modelio.logprobs import tempered_log_softmax


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None = None,
) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """Pick the next token; return it with its logprob and the top-k alternatives.

    The logprob is taken under the tempered, untruncated, unconstrained distribution: top-p
    and a grammar (`allowed`: the logits with forbidden tokens at -inf) only decide which
    tokens may be drawn; they are not part of the policy the learner differentiates.
    """
    logprobs = tempered_log_softmax(logits, params.logprob_temperature)
    drawn_from = logprobs if allowed is None else tempered_log_softmax(allowed, params.logprob_temperature)
    if params.temperature <= 0:
        token = int(torch.argmax(drawn_from))
    else:
        probs = drawn_from.exp()
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
            keep = (sorted_probs.cumsum(0) - sorted_probs) < params.top_p
            pick = torch.multinomial(sorted_probs * keep, 1, generator=generator)
            token = int(order[pick])
        else:
            token = int(torch.multinomial(probs, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return token, float(logprobs[token]), top


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator | None:
    """A seeded generator on the device the logits live on (torch refuses to mix them)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
