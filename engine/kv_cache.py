"""Key/value tensors of transformers' `DynamicCache`, taken out and put back without copies.

Prefix reuse and batched decoding both move a sequence's attention cache around: keep it after
a reply, cut it to the prefix a later prompt shares, pad it on the left to sit in a batch beside
longer sequences, take a finished row out. transformers' `DynamicCache` keeps one layer object
per decoder layer whose `keys`/`values` are [batch, heads, tokens, head_dim] tensors.

Its `DynamicLayer` appends with `torch.cat`, copying the whole cache at every decoding step:
36% of a SmolLM2 step for six 800-token sequences on 2 CPU cores. `GrowingLayer` appends in
place into spare room instead (a quarter more than needed when it runs out), and hands the
model views of the filled part. A view taken earlier never changes: positions are only ever
written past the end of every view of the buffer, and a cache built from views (`to_cache`)
owns no room, so its first append copies them into a buffer of its own.

Only caches of such plain layers are handled (sliding-window or linear-attention layers cannot
be cut to an arbitrary prefix): `reusable` says whether a cache is one.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# Per decoder layer: (keys, values), each [batch, kv_heads, tokens, head_dim].
KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


# Spare positions a GrowingLayer adds when it runs out of room: this fraction of what it holds.
GROWTH = 0.25
MIN_GROWTH = 64


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends in place (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None  # buffers `keys`/`values` view

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[3]))
            self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[3]))
        n, add = self.keys.shape[2], key_states.shape[2]
        if self._room is None or n + add > self._room[0].shape[2]:
            size = n + add + max(MIN_GROWTH, int(GROWTH * (n + add)))
            room = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buffer = new.new_empty((*new.shape[:2], size, new.shape[3]))
                buffer[:, :, :n].copy_(old)
                room.append(buffer)
            self._room = (room[0], room[1])
        keys, values = self._room
        keys[:, :, n : n + add].copy_(key_states)
        values[:, :, n : n + add].copy_(value_states)
        self.keys, self.values = keys[:, :, : n + add], values[:, :, : n + add]
        return self.keys, self.values


def new_cache() -> DynamicCache:
    """An empty cache whose layers append in place."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by: transformers 5.2x renamed
    `past_key_values` to `cache` (the old name warns at every step and goes in 5.40); the
    versions before it know only the old one. The cache is updated in place either way, so the
    caller keeps the object it passed rather than reading it back by either name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def reusable(cache: object) -> bool:
    """True if `cache` is a DynamicCache of plain, initialised layers."""
    layers = getattr(cache, "layers", None)
    return (
        type(cache) is DynamicCache and bool(layers)
        and all(type(layer) in (DynamicLayer, GrowingLayer) and layer.is_initialized for layer in layers)
    )


def tensors(cache: DynamicCache) -> KV:
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def to_cache(kv: KV) -> DynamicCache:
    """A cache holding `kv` as it is (no copy until its first append)."""
    cache = new_cache()
    layers = []
    for keys, values in kv:
        layer = GrowingLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layers.append(layer)
    cache.layers = layers
    return cache


def length(kv: KV) -> int:
    return kv[0][0].shape[-2]


def nbytes(kv: KV) -> int:
    """Memory held by `kv`: whole buffers, spare room included, not just the viewed part."""
    return sum(keys.untyped_storage().nbytes() + values.untyped_storage().nbytes() for keys, values in kv)


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


def stack(rows: list[KV]) -> KV:
    """The rows of every KV in `rows`, in order (all the same length)."""
    return rows[0] if len(rows) == 1 else tuple(
        (torch.cat([row[layer][0] for row in rows]), torch.cat([row[layer][1] for row in rows]))
        for layer in range(len(rows[0])))


def select_rows(kv: KV, rows: list[int]) -> KV:
    index = torch.tensor(rows, device=kv[0][0].device)
    return tuple((keys.index_select(0, index), values.index_select(0, index)) for keys, values in kv)


class ReadOnlyLayer(DynamicLayer):
    """Keys and values computed before, which a forward pass reads but never extends: `update`
    returns them with the new positions after them and keeps nothing. Activation checkpointing
    runs each decoder layer twice (forward, and again in the backward pass); a layer that
    appended would see its own positions twice on the second run."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def read_only_cache(kv: KV) -> DynamicCache:
    """A cache that gives `kv` to every pass through it and keeps none of the new positions."""
    cache = DynamicCache()
    cache.layers = [ReadOnlyLayer(keys, values) for keys, values in kv]
    return cache


def _checkpointed_layer_class() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52
        return None
    return GradientCheckpointingLayer if hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache") else None


def cache_survives_checkpointing() -> bool:
    """Whether this transformers lets a layer under activation checkpointing read a cache (a
    `read_only_cache`); the versions before it drop any cache there, as they must for one that
    appends."""
    return _checkpointed_layer_class() is not None


@contextlib.contextmanager
def cache_under_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Inside, `model`'s checkpointed decoder layers keep the cache they are given: only for a
    `read_only_cache`, which a layer's second run reads exactly as its first."""
    layer_class = _checkpointed_layer_class()
    layers = [m for m in model.modules() if layer_class is not None and isinstance(m, layer_class)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's own (False)
