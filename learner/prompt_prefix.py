"""An agent's long prompt read once per weights, without gradients; only what is near the replies trains.

A rated OpenClaw turn is a 3.8-4.5k-token prompt (the agent's system prompt, its tools, the
conversation) and a reply of up to 256 tokens. Each of an update's training passes read the whole
row forward, again in the backward pass (activation checkpointing) and back: ~70 s a row on two
cores, 56% of an update (BENCHMARKS.md, "Fast on the person's own machine"). At that length most
of the cost is attention over the prompt and the prompt's own layers, whose gradient reaches the
adapter only through the keys and values the reply attends to.

So a long row is split: its prompt up to `grad_tokens` before the micro-batch's first reply token
is read without gradients (the *prefix*), and the rest (those last prompt tokens, the replies and
what lies between them) is read with gradients, attending to the prefix's keys and values through
a cache no pass extends (engine/kv_cache.py `read_only_cache`). The forward values are the same
as one pass over the row; the gradient leaves out what flows through the prefix's keys and values.
On the four OpenClaw samples of bench.update_speed its cosine with the whole gradient is 0.92 at
256 tokens (0.89 at 0, 0.95 at 1,024), and one update took 316 s instead of 757 (BENCHMARKS.md,
"Fast on the person's own machine").

The prefix's keys and values depend only on the weights, and an update's passes read them once:
at the weights the update starts from, where the publish gate has just read the serving
version's prompts through the same kept prefixes (learner/readings.py). The later passes attend
to them although each optimizer step moves the weights a little: on the four OpenClaw samples
the update's direction is the same to a cosine of 0.996 as with the prefixes read anew after
every step, its KL 0.058 against 0.057, and its passes take 17% less time (docs/benchmark-log.md,
"The prompts' prefixes read once per update"). After the passes the trainer drops them
(`clear`, as at every other change of the weights: a shortening, an undo, a load), so the KL
line search reads them at the trained weights, and the gate's reading of the candidate takes
them from it. Rows of a micro-batch with the same
prefix (one agent's turns, one setup) compute it once, and a longer prefix (another micro-batch's,
split later) computes only what it adds to the longest one kept. Rows shorter than `MIN_PREFIX` before their
window are read whole, as before: a chat turn's gradient is exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from nextstate.engine import kv_cache
from nextstate.engine.prefix_cache import PrefixCache

# Prompt tokens before a micro-batch's first reply token that still train: the person's last
# message and the template around it.
GRAD_TOKENS = 256
# A prefix shorter than this is not worth a pass of its own.
MIN_PREFIX = 512
# Prefixes kept between two weight changes: 4k tokens of SmolLM2 are 176 MB in float32.
KEPT_BYTES = 1 << 30


class PromptPrefixes:
    """The prefixes of one update's rows, read at the weights now (see the module's docstring)."""

    def __init__(self, grad_tokens: int | None = GRAD_TOKENS) -> None:
        self.grad_tokens = grad_tokens  # None: every row read whole, its gradient exact
        self._kept = PrefixCache(KEPT_BYTES)
        self._active = False

    @contextlib.contextmanager
    def during_update(self) -> Iterator[None]:
        """Rows are split only inside. What was read at the weights the update starts from (the
        gate's reading of the serving version) serves its passes, and what the KL line search
        read after them stays for the gate's reading of the candidate: the trainer drops them
        after the passes and wherever else the weights change (`clear`)."""
        self._active = True
        try:
            yield
        finally:
            self._active = False

    @property
    def kept(self) -> PrefixCache:
        """Prompts' keys and values at the weights now: the gate reads its candidate's prompts
        through them, from what the update's last pass read (learner/readings.py)."""
        return self._kept

    def clear(self) -> None:
        """The weights changed (a step, a shortening, an undo, a load, another scope's adapter):
        no kept prefix holds for them."""
        self._kept.drop(None)

    def split(self, reply_starts: Sequence[int]) -> int:
        """Where a micro-batch whose rows' first reply tokens are at `reply_starts` is split:
        the prefix's length, or 0 to read the rows whole."""
        if not self._active or self.grad_tokens is None or not kv_cache.cache_survives_checkpointing():
            return 0
        split = min(reply_starts) - self.grad_tokens
        return split if split >= MIN_PREFIX else 0

    def hidden(self, backbone: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, split: int) -> torch.Tensor:
        """The backbone's last hidden states of ids[:, split:] ([rows, tokens - split, hidden]),
        with gradients where they are enabled, after each row's prefix ids[:, :split]."""
        prefixes = [tuple(row) for row in ids[:, :split].tolist()]
        kv = {p: read_through(self._kept, backbone, list(p)) for p in dict.fromkeys(prefixes)}
        cache = kv_cache.read_only_cache(kv_cache.stack([kv[p] for p in prefixes]))
        with kv_cache.cache_under_checkpointing(backbone):
            return backbone(input_ids=ids[:, split:], attention_mask=mask,
                            **{kv_cache.cache_argument(backbone): cache}).last_hidden_state



def read_through(kept: PrefixCache, model: torch.nn.Module, ids: list[int], named_by: torch.nn.Module | None = None
                 ) -> kv_cache.KV:
    """The keys and values of `ids` at `model`'s weights now (no gradients), computed from the
    longest prefix `kept` holds and kept there in turn. `named_by`: the module whose forward names
    the cache argument (a peft model passes it on by name without declaring it)."""
    hit = kept.longest(None, None, ids, len(ids))
    done = hit.length if hit is not None else 0
    if hit is not None and done == len(ids):
        return hit.kv
    cache = kv_cache.to_cache(hit.kv) if hit is not None else kv_cache.new_cache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[done:]], device=model.device), use_cache=True,
              **{kv_cache.cache_argument(named_by or model): cache})
    kv = kv_cache.tokens(kv_cache.tensors(cache), 0, len(ids), copy=True)
    kept.put(None, None, ids, kv)
    return kv
