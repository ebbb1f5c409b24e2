"""How many tokens a training pass may hold, from what the passes actually cost.

A learner step on an agent's samples must not take the server down with it: the first update of
a real OpenClaw conversation once reached 18 GB and was killed by the kernel. A fixed token
budget (`NEXTSTATE_MICRO_BATCH_TOKENS`) is a guess that is right for one model on one machine.
So every training pass is measured — the memory it added at its peak, against its padded tokens
— and before a step the learner compares what its passes will need with what is free now
(MemAvailable or the container's limit on the CPU, the device's free memory on a GPU, and at
most `NEXTSTATE_LEARNER_MEMORY_MB`): micro-batches shrink to what fits, and a step whose longest
sample alone would not fit is not started (the samples stay ready; learner/service.py records
the refusal and retries later).

The cost of a pass is modelled as `fixed + per_token × tokens`: `fixed` is the LM head's chunk
of logits (with its log-softmax and gradient) and a margin, `per_token` what grows with the
sequence (checkpointed layer inputs and attention outputs, one layer recomputed in the backward
pass). Until a pass has been measured, `per_token` comes from the model's shape (a deliberate
over-estimate: an 8k-token SmolLM2 pass on the CPU measured +1.00 GiB with 341-row logit chunks,
the prior says 2.0 GB with SAFETY); after, from the longest measured pass — the one nearest to
the passes that can fail. An estimate is used with `SAFETY` on top.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from nextstate.core.memory import free_bytes as host_free_bytes
from nextstate.core.memory import resident_bytes

# What a measured pass may have missed (the CPU's peak is sampled, other threads allocate too).
SAFETY = 1.2
# Share of the free memory a pass may take: the rest is for serving (its KV cache grows) and
# for whatever else runs on the machine.
FREE_SHARE = 0.8
# Passes shorter than this are not used to fit `per_token`: one-time allocations (thread pools,
# kernel caches) dominate them and would predict gigabytes for a long sample.
MIN_FIT_TOKENS = 1024
# How often the CPU sampler reads the resident set during a pass.
SAMPLE_S = 0.01
MARGIN_BYTES = 256 << 20


@dataclass(frozen=True)
class Refusal:
    """A step that would not fit: what its longest sample needs and what is free."""

    tokens: int
    needed: int
    available: int

    def reason(self) -> str:
        return (f"memory: its longest sample ({self.tokens} tokens) needs about {self.needed / 2**30:.2f} GiB for a "
                f"training pass and {self.available / 2**30:.2f} GiB is free for it; it trains once memory frees up "
                "(or set NEXTSTATE_MAX_TRAIN_TOKENS lower, or NEXTSTATE_LEARNER_MEMORY_MB higher)")


class MemoryBudget:
    def __init__(self, config, dtype: torch.dtype, device: str, logit_rows: int, cap_mb: int = 0) -> None:
        self.device = device
        self.cap = cap_mb << 20 if cap_mb > 0 else None
        size = torch.finfo(dtype).bits // 8
        hidden, layers = config.hidden_size, config.num_hidden_layers
        intermediate = getattr(config, "intermediate_size", 4 * hidden)
        # the LM head's chunk: logits, their log-softmax and its gradient, in fp32
        self.fixed = logit_rows * config.vocab_size * 4 * 3 + MARGIN_BYTES
        # checkpointed inputs of every layer and their attention's outputs (learner/checkpointing.py),
        # and one layer's activations and gradients recomputed
        self.floor_per_token = 2 * layers * hidden * size
        self.prior_per_token = self.floor_per_token + (6 * hidden + 4 * intermediate) * size * 2
        self.measured: tuple[int, int] | None = None  # the longest measured pass: (tokens, added bytes)

    # ---------------------------------------------------------------- the model

    @property
    def per_token(self) -> int:
        if self.measured is None:
            return self.prior_per_token
        tokens, added = self.measured
        return max(self.floor_per_token, (added - self.fixed) // tokens)

    def needed(self, tokens: int) -> int:
        """Bytes a training pass over `tokens` padded tokens is expected to add, with SAFETY."""
        return int((self.fixed + self.per_token * tokens) * SAFETY)

    def record(self, tokens: int, added: int) -> None:
        """A measured training pass. The longest one is kept (ties: the costlier)."""
        if tokens < MIN_FIT_TOKENS:
            return
        if self.measured is None or (tokens, added) > self.measured:
            self.measured = (tokens, added)

    # ---------------------------------------------------------------- the machine

    def available(self) -> int:
        """Bytes a pass may add now: FREE_SHARE of what is free, at most the cap."""
        free = int(_free_bytes(self.device) * FREE_SHARE)
        return min(free, self.cap) if self.cap is not None else free

    def plan(self, lengths: list[int], budget_tokens: int) -> int | Refusal:
        """The padded tokens a micro-batch may hold for a step over samples of `lengths`
        (`budget_tokens` at most, never less than the longest), or why the step must not start."""
        available, longest = self.available(), max(lengths)
        if self.needed(longest) > available:
            return Refusal(longest, self.needed(longest), available)
        fits = int((available / SAFETY - self.fixed) // max(1, self.per_token))
        return max(longest, min(budget_tokens, fits))

    def meter(self) -> PeakMeter:
        return PeakMeter(self.device)


class PeakMeter:
    """The memory a block adds at its peak: the CUDA allocator's own peak on a GPU; on the CPU
    the resident set, sampled by a thread (the process's high-water mark could be reset, but
    that would take it from whoever else reads it — a benchmark, an operator)."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.added = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakMeter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = self._peak = resident_bytes()
            self._thread = threading.Thread(target=self._sample, name="learner-memory", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._peak = max(self._peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.added = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
        else:
            self._stop.set()
            self._thread.join()
            self.added = max(0, max(self._peak, resident_bytes()) - self._start)


def _free_bytes(device: str) -> int:
    """Memory free for the learner now. GPU: the device's free memory plus what torch's caching
    allocator holds unused. CPU: what the machine (or its container) has available."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return host_free_bytes()
