"""A least-recently-used map bounded by the total size of its entries, not their number.

Caches of text and token ids (the prompt encoder's pieces, the sessions' message digests) hold
entries from a few bytes to a whole system prompt: a count bound would let a few agents'
prompts take any amount of memory, a size bound does not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """`get` refreshes an entry; `put` adds one and pushes the least recently used out until
    the sizes (`size(key, value)`) add up to `max_size` at most. A key already held keeps its
    value (`discard` it first to replace it), and an entry larger than the whole budget is not
    kept. Not thread-safe: callers sharing one across threads lock around it."""

    def __init__(self, max_size: int, size: Callable[[K, V], int]) -> None:
        self.max_size = max_size
        self._size = size
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first
        self.total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        try:
            value = self._entries[key]
        except KeyError:
            return default
        self._entries.move_to_end(key)
        return value

    def discard(self, key: K) -> None:
        if key in self._entries:
            self.total -= self._size(key, self._entries.pop(key))

    def keys(self) -> list[K]:
        return list(self._entries)

    def put(self, key: K, value: V) -> None:
        size = self._size(key, value)
        if key in self._entries or size > self.max_size:
            return
        self._entries[key] = value
        self.total += size
        while self.total > self.max_size:
            old_key, old = self._entries.popitem(last=False)
            self.total -= self._size(old_key, old)
