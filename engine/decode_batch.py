"""Generations that decode together: one forward pass per step for all of them.

On 2 CPU cores one SmolLM2 decoding step costs about as much for eight sequences as for one
(the time goes to reading the weights and to Python, not to arithmetic), so concurrent streams
and the judge's m votes on a turn advance together, one token each per pass. Rows may use
different adapters (every user has their own): peft then applies each row's LoRA to its row
(`adapter_names=`), so users of different versions still share the pass. Sequences join
after their prompt is prefilled and leave when they finish or are cancelled, between steps
(continuous batching).

The batch's cache holds every row at one length: a row shorter than the longest is padded on
the left, its padding masked out by the attention mask, and each row is given its own
positions, so a row's logits are those it would get alone (to float tolerance; a test checks).
When the longest row leaves, padding every row shares is cut away.

transformers' own continuous batching (`generate_batch`, `init_continuous_batching`) was
considered first: it has no per-request LoRA adapter, no grammar-constrained sampling, no
scoring passes and no priority between users and background work, all of which this engine
needs, and it brings its own paged cache in place of the prefix cache here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from nextstate.engine import kv_cache
from nextstate.engine.kv_cache import KV


@dataclass(eq=False)
class DecodeBatch:
    background: bool
    rows: list = field(default_factory=list)  # Jobs, in the order of the cache's rows
    pads: list[int] = field(default_factory=list)  # left padding of each row
    cache: DynamicCache | None = None  # kept across steps: its layers append in place
    length: int = 0  # positions in the cache, padding included

    @property
    def kv(self) -> KV | None:
        return None if self.cache is None else kv_cache.tensors(self.cache)

    @kv.setter
    def kv(self, kv: KV | None) -> None:
        self.cache = None if kv is None else kv_cache.to_cache(kv)

    def join(self, job, kv: KV) -> None:
        """Add a sequence whose cache is `kv` (a batch of one); its last sampled token is fed next."""
        n = kv_cache.length(kv)
        if self.cache is None:
            self.kv, self.pads, self.length = kv, [0], n
        else:
            if n > self.length:
                grow = n - self.length
                self.kv = kv_cache.pad_left(self.kv, grow)
                self.pads = [pad + grow for pad in self.pads]
                self.length = n
            self.kv = kv_cache.stack([self.kv, kv_cache.pad_left(kv, self.length - n)])
            self.pads.append(self.length - n)
        self.rows.append(job)
        job.batch = self

    def leave(self, job) -> KV:
        """Take a row out; returns its own cache (copied out of the batch)."""
        row = next(i for i, other in enumerate(self.rows) if other is job)
        out = kv_cache.tokens(self.kv, self.pads[row], self.length, row=row, copy=True)
        job.batch = None
        keep = [i for i in range(len(self.rows)) if i != row]
        if not keep:
            self.rows, self.pads, self.cache, self.length = [], [], None, 0
            return out
        self.kv = kv_cache.select_rows(self.kv, keep)
        self.rows = [self.rows[i] for i in keep]
        self.pads = [self.pads[i] for i in keep]
        shared = min(self.pads)
        if shared:
            self.kv = kv_cache.tokens(self.kv, shared, self.length, copy=True)
            self.pads = [pad - shared for pad in self.pads]
            self.length -= shared
        return out

    def inputs(self, device: torch.device, cache_argument: str) -> dict:
        """The forward pass's arguments for this step: each row's last token, at its position
        (`cache_argument`: the model's keyword for its cache, kv_cache.cache_argument)."""
        ids = torch.tensor([[job.last_token] for job in self.rows], device=device)
        positions = torch.tensor([[self.length - pad] for pad in self.pads], device=device)
        mask = None
        if any(self.pads):
            mask = torch.ones((len(self.rows), self.length + 1), dtype=torch.long, device=device)
            for i, pad in enumerate(self.pads):
                mask[i, :pad] = 0
        return {
            "input_ids": ids, "position_ids": positions, "attention_mask": mask,
            cache_argument: self.cache,
        }

    def advanced(self) -> None:
        """The step ran: the cache (appended to in place) holds one more position per row."""
        self.length += 1
