"""Attention caches kept after a sequence ends, so a later prompt that starts the same way
prefills only what is new.

An agent's next request is its last prompt, our reply and a few new messages: thousands of
tokens already computed once. Each entry is the cache of one token sequence under one adapter
(LoRA changes the keys and values, so a cache never crosses adapters). A lookup returns the
longest prefix any entry shares with the prompt; entries are kept within a byte budget, least
recently used first out. Entries are partitioned by a salt as well (`SamplingParams.cache_salt`,
one per user): a hit would tell a user that someone else sent the same text. The judge's votes
on one turn share their prompt, and a prefilling job stores its progress after every chunk, so
votes that prefill side by side take turns extending one cache instead of each computing it
(see `ModelRunner._reuse_prefix`).

Pure bookkeeping on the engine's worker thread: no locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nextstate.engine import kv_cache
from nextstate.engine.kv_cache import KV

# Prompts are compared this many tokens at a time before the first difference is looked for.
_COMPARE_BLOCK = 256


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + _COMPARE_BLOCK] == b[i : i + _COMPARE_BLOCK]:
        i += _COMPARE_BLOCK
    if i >= n:  # the last block ran past the shorter list: it matched to its end
        return n
    stop = min(i + _COMPARE_BLOCK, n)
    while i < stop and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class Entry:
    adapter: str | None
    salt: str | None
    ids: list[int]
    kv: KV
    nbytes: int
    used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Hit:
    length: int  # prompt tokens whose keys and values are in kv
    kv: KV


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._entries: list[Entry] = []
        self.evictions = 0  # entries pushed out by the budget

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, adapter: str | None, salt: str | None, ids: list[int], limit: int) -> Hit | None:
        """The cached keys and values of the longest prefix of `ids` (at most `limit` tokens),
        among the entries of this adapter and salt."""
        best, best_len = None, 0
        for entry in self._entries:
            if entry.adapter != adapter or entry.salt != salt:
                continue
            n = min(common_prefix(entry.ids, ids), limit)
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            return None
        best.used = time.monotonic()
        return Hit(best_len, kv_cache.tokens(best.kv, 0, best_len))

    def put(self, adapter: str | None, salt: str | None, ids: list[int], kv: KV) -> None:
        """Keep the cache of `ids` (kv covers exactly those tokens). An entry whose tokens are a
        prefix of `ids` is replaced; if an entry already covers `ids`, that one is kept."""
        if not ids or self.budget <= 0:
            return
        size = kv_cache.nbytes(kv)
        if size > self.budget:
            return
        keep = []
        for entry in self._entries:
            if entry.adapter == adapter and entry.salt == salt:
                shared = common_prefix(entry.ids, ids)
                if shared == len(ids):  # already covered, as long or longer
                    entry.used = time.monotonic()
                    return
                if shared == len(entry.ids):  # the new one extends it
                    continue
            keep.append(entry)
        keep.append(Entry(adapter, salt, list(ids), kv, size))
        self._entries = keep
        self._evict()

    def drop(self, adapter: str | None) -> None:
        """Forget an adapter's caches (it was unloaded; its name may come back with new weights)."""
        self._entries = [entry for entry in self._entries if entry.adapter != adapter]

    def _evict(self) -> None:
        total = self.nbytes
        if total <= self.budget:
            return
        for entry in sorted(self._entries, key=lambda e: e.used):
            if total <= self.budget:
                break
            self._entries.remove(entry)
            total -= entry.nbytes
            self.evictions += 1
