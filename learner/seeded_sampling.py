"""Sampling at temperature 1 where each row draws from a random stream of its own.

The publish gate compares a candidate's sampled replies with the base model's, each prompt's
from the same random draws (common random numbers: the two differ only where the models do).
`generate(do_sample=True)` draws every row from one shared stream, so a prompt's draws depend
on which other prompts share its batch, and the gate had to generate prompt by prompt, twice
the time of its greedy check. The Gumbel-max trick gives the same distribution with the
randomness in our hands: argmax(logits + G), G i.i.d. standard Gumbel, is a draw from
softmax(logits). A logits processor adds G drawn from a generator seeded by the row and the
step, and decoding stays greedy, so rows are independent of their batch, every row of a batch
samples at once, and the process's own random stream is never touched.
"""

from __future__ import annotations

import hashlib
import json

import torch
from transformers import LogitsProcessor

# uniform draws are kept inside (0, 1): -log(-log(u)) is infinite at either end
UNIFORM_FLOOR = 1e-10


def row_seed(prompt: list[int], reply: int) -> int:
    """A stream per (prompt, reply index): the same for every weights asked, whatever else runs."""
    digest = hashlib.blake2b(json.dumps([reply, prompt]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # torch seeds are signed 64-bit


class SeededGumbel(LogitsProcessor):
    """Adds standard Gumbel noise from each row's own seeded stream; with greedy decoding the
    result is a draw at temperature 1 from whatever the other processors left."""

    def __init__(self, seeds: list[int], prompt_width: int) -> None:
        self.seeds = seeds
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        generator = torch.Generator(device=scores.device)
        noise = torch.empty(scores.shape[-1], device=scores.device, dtype=torch.float32)
        rows = []
        for seed in self.seeds:
            generator.manual_seed((seed + step * 0x9E3779B97F4A7C15) % 2**63)
            noise.uniform_(UNIFORM_FLOOR, 1 - UNIFORM_FLOOR, generator=generator)
            rows.append(-torch.log(-torch.log(noise)))
        return scores + torch.stack(rows).to(scores.dtype)
