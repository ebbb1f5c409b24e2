"""Samples grouped into forward passes by a token budget, each shared prefix computed once.

An optimizer step's samples vary from a few hundred tokens (a chat reply) to tens of thousands
(an agent turn with its whole context). One forward per sample leaves a GPU idle on the short
ones; one forward for the whole batch does not fit on the long ones. So the samples of a step
are packed into micro-batches whose padded size (rows × longest row) stays within
`micro_batch_tokens`, shortest first so that rows of a micro-batch have similar lengths and
little is padding; a sample longer than the budget goes alone. Gradients of the micro-batches
add up to the step's (the loss is a sum over tokens divided by the step's token count), so the
packing changes speed and memory, never the update.

Rated turns of one agent conversation nest: turn k's prompt and reply, token for token, begin
turn k+1's prompt (the engine's prefix cache serves them so). A causal model's logits at a
row's positions do not depend on what follows them, so a row that begins another row is not
computed at all: its responses are read off the longer row (its *host*), and the losses of both
flow back through one graph. Four rated OpenClaw turns were four passes over ~4-5k tokens each;
they are one pass over the longest (docs/benchmark-log.md, "An update in about a minute").
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_hosts(rows: Sequence[Sequence[int]]) -> list[int]:
    """For each row, the index of the row its positions are computed in: the longest row that
    begins with it, or itself."""
    hosts = list(range(len(rows)))
    computed: list[int] = []
    for i in sorted(range(len(rows)), key=lambda j: -len(rows[j])):
        n = len(rows[i])
        host = next((h for h in computed if list(rows[h][:n]) == list(rows[i])), None)
        if host is None:
            computed.append(i)
        else:
            hosts[i] = host
    return hosts


def padded_tokens(rows: Sequence[Sequence[int]]) -> int:
    """Tokens one forward pass over `rows` holds: the rows it computes × the longest."""
    computed = set(prefix_hosts(rows))
    return len(computed) * max((len(rows[i]) for i in computed), default=0)


def micro_batches(rows: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Indices into `rows`, grouped so that each group's `padded_tokens` <= budget (or it
    computes one row). A row that begins another goes with its host and costs nothing. Every
    index appears exactly once."""
    hosts = prefix_hosts(rows)
    guests: dict[int, list[int]] = {}
    for i, host in enumerate(hosts):
        guests.setdefault(host, []).append(i)
    groups: list[list[int]] = []
    current: list[int] = []
    for host in sorted(guests, key=lambda h: len(rows[h])):
        # sorted ascending: the newest host is the longest, so the padded size is hosts × it
        if current and (len(current) + 1) * len(rows[host]) > budget:
            groups.append(current)
            current = []
        current.append(host)
    if current:
        groups.append(current)
    return [sorted(i for host in group for i in guests[host]) for group in groups]


def length_groups(lengths: Sequence[int], ratio: float = 2.0) -> list[list[int]]:
    """Indices grouped for left-padded batches, shortest first: a group takes lengths up to
    `ratio` times its shortest, so no row is mostly padding."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if groups and lengths[i] <= ratio * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
