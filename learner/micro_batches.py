"""Samples grouped into forward passes by a token budget.

An optimizer step's samples vary from a few hundred tokens (a chat reply) to tens of thousands
(an agent turn with its whole context). One forward per sample leaves a GPU idle on the short
ones; one forward for the whole batch does not fit on the long ones. So the samples of a step
are packed into micro-batches whose padded size (rows × longest row) stays within
`micro_batch_tokens`, shortest first so that rows of a micro-batch have similar lengths and
little is padding; a sample longer than the budget goes alone. Gradients of the micro-batches
add up to the step's (the loss is a sum over tokens divided by the step's token count), so the
packing changes speed and memory, never the update.
"""

from __future__ import annotations


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into `lengths`, grouped so that len(group) * max(length in group) <= budget
    (or a group of one). Every index appears exactly once."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        # sorted ascending: the newest member is the longest, so the padded size is rows × it
        if current and (len(current) + 1) * lengths[i] > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
