"""Activation checkpointing that keeps attention's outputs.

Agent samples run to thousands of tokens, so a training pass keeps only each decoder layer's
input and recomputes the layer in the backward pass (memory grows with a sample's length; the
first agent-size update of a real OpenClaw conversation once reached 18 GB without it). At an
agent's context the costliest part of that recomputation is attention over the kept prompt
(4k keys for every trained token), while its output is one hidden-size vector a token: torch's
selective checkpointing saves exactly that op's outputs and recomputes the rest of the layer
(the projections and the MLP, whose activations are the large ones).

Measured on bench.update_speed's four OpenClaw samples (2 cores, SmolLM2-135M, one update, the
same loss and KL to 1e-9; docs/benchmark-log.md, tenth pass of issue 76): 2-11% shorter passes
than whole layers recomputed (three pairs), +0.03-0.05 GB at the peak. Saving every matmul's
output too was 173 s against 196 at +1.7 GB, no checkpointing 149 s at +2.7 GB: an agent-size
update must not need more memory than it did (+1.35 GiB for 4 × 4,096 tokens).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Every backend's fused attention op (the CPU's flash kernel, CUDA's flash, efficient and cuDNN ones)
SAVED_OPS = "scaled_dot_product"


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if SAVED_OPS in str(op) else CheckpointPolicy.PREFER_RECOMPUTE


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint each of `model`'s decoder layers, its attention's outputs kept (transformers' own
    switch, under the name of the installed version)."""
    kwargs = {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_attention)}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
