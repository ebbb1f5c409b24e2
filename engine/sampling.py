"""Token selection from one step's logits, with the logprobs that training needs."""

from __future__ import annotations

import torch

from engine.base import SamplingParams


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """Pick the next token; return it with its logprob and the top-k alternatives.

    The logprob is taken under the tempered, untruncated distribution: top-p only decides
    which tokens may be drawn, it is not part of the policy the learner differentiates.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
    if params.temperature <= 0:
        token = int(torch.argmax(logits))
    else:
        probs = logprobs.exp()
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
            keep = (sorted_probs.cumsum(0) - sorted_probs) < params.top_p
            choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
            token = int(order[choice])
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
