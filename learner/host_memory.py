"""Freed training memory goes back to the system instead of staying in the process's heap.

A learner step on agent-size samples allocates and frees hundreds of tensors of megabytes
each. glibc serves allocations that size from its heap once its "dynamic mmap threshold" has
risen (up to 32 MB), and a heap only shrinks from its top: the freed blocks stay resident,
fragmented, and the next step allocates beside them. Measured here on SmolLM2-135M, one
forward and backward pass over a 4,096-token sample (activation checkpointing, SDPA) peaked
at +2.5 GB resident with glibc's defaults and at +0.96 GB with a fixed 1 MB threshold (at
8,192 tokens: +1.4 GB), at the same speed within noise (41-48 s a pass on two cores); the
learner's whole update on two 8k-token samples added +13.4 GiB against +1.8 GiB
(bench.learner_memory, BENCHMARKS.md), and the first agent-size update of a real OpenClaw
conversation had reached 18 GB. A fixed threshold makes every allocation of 1 MB or more its
own mapping, returned to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def release_freed_memory() -> bool:
    """Set glibc's mmap threshold to 1 MB (which also stops it from rising). True if set; a
    no-op on other C libraries and systems."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD) was refused; freed memory may stay resident")
    return ok
