"""Key/value tensors of transformers' `DynamicCache`, taken out and put back without copies.

Prefix reuse and batched decoding both move a sequence's attention cache around: keep it after
a reply, cut it to the prefix a later prompt shares, pad it on the left to sit in a batch beside
longer sequences, take a finished row out. transformers' `DynamicCache` keeps one
`DynamicLayer` per decoder layer whose `keys`/`values` are [batch, heads, tokens, head_dim]
tensors, and every append makes new tensors (`torch.cat`), so a snapshot of the tensors stays
valid while the cache goes on growing. `DynamicCache(ddp_cache_data=...)` would copy them once
more; building the layers here does not.

Only caches made of plain `DynamicLayer`s are handled (sliding-window or linear-attention
layers cannot be cut to an arbitrary prefix): `reusable` says whether a model's cache is one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Per decoder layer: (keys, values), each [batch, kv_heads, tokens, head_dim].
KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def reusable(cache: object) -> bool:
    """True if `cache` is a DynamicCache of plain, initialised DynamicLayers."""
    layers = getattr(cache, "layers", None)
    return (
        type(cache) is DynamicCache and bool(layers)
        and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)
    )


def tensors(cache: DynamicCache) -> KV:
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def to_cache(kv: KV) -> DynamicCache:
    cache = DynamicCache()
    layers = []
    for keys, values in kv:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layers.append(layer)
    cache.layers = layers
    return cache


def length(kv: KV) -> int:
    return kv[0][0].shape[-2]


def nbytes(kv: KV) -> int:
    return sum(keys.nbytes + values.nbytes for keys, values in kv)


def tokens(kv: KV, start: int, stop: int, row: int | None = None, copy: bool = False) -> KV:
    """Positions start..stop (of one batch row, kept as a batch of one); `copy` detaches the
    result from the (larger) tensors it was cut from, so holding it does not hold them."""
    rows = slice(None) if row is None else slice(row, row + 1)

    def cut(t: torch.Tensor) -> torch.Tensor:
        part = t[rows, :, start:stop, :]
        return part.clone() if copy else part

    return tuple((cut(keys), cut(values)) for keys, values in kv)


def pad_left(kv: KV, n: int) -> KV:
    """n zero positions in front of every row (masked out by the attention mask)."""
    if n <= 0:
        return kv

    def pad(t: torch.Tensor) -> torch.Tensor:
        zeros = t.new_zeros((*t.shape[:2], n, t.shape[3]))
        return torch.cat([zeros, t], dim=2)

    return tuple((pad(keys), pad(values)) for keys, values in kv)


def stack_rows(a: KV, b: KV) -> KV:
    """Rows of `a` then rows of `b` (same length)."""
    return tuple((torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a, b, strict=True))


def select_rows(kv: KV, rows: list[int]) -> KV:
    index = torch.tensor(rows, device=kv[0][0].device)
    return tuple((keys.index_select(0, index), values.index_select(0, index)) for keys, values in kv)
