"""The gate's sampler: greedy decoding of Gumbel-perturbed logits is sampling at temperature 1."""

from __future__ import annotations

import torch

from nextstate.learner.seeded_sampling import SeededGumbel, row_seed


def test_gumbel_max_draws_follow_the_softmax_and_each_row_keeps_its_own_stream():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    draws = 4000
    seeds = [row_seed([1, 2, 3], j) for j in range(draws)]
    noisy = SeededGumbel(seeds, prompt_width=3)(torch.zeros(draws, 3, dtype=torch.long), logits.expand(draws, -1))
    counts = torch.bincount(noisy.argmax(-1), minlength=5).float() / draws
    expected = torch.softmax(logits, -1)
    assert counts[4] == 0, "a token the other processors ruled out is never drawn"
    # four standard errors of a share at 4000 draws: at most 0.032
    assert torch.allclose(counts, expected, atol=4 * (0.25 / draws) ** 0.5), (counts, expected)
    one = SeededGumbel(seeds[:1], prompt_width=3)(torch.zeros(1, 3, dtype=torch.long), logits[None])
    assert torch.equal(one[0], noisy[0]), "a row's draw does not depend on its batch"
    later = SeededGumbel(seeds[:1], prompt_width=3)(torch.zeros(1, 4, dtype=torch.long), logits[None])
    assert not torch.equal(later[0], one[0]), "each step draws afresh"
    assert row_seed([1, 2, 3], 0) != row_seed([1, 2, 3], 1) != row_seed([1, 2], 1)
