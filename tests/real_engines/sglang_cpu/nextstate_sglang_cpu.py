"""Lets a stock SGLang run its torch-native path on a CPU-only torch, for tests.

Imported at start-up of the test SGLang (a .pth line in its environment, active only when
NEXTSTATE_SGLANG_CPU=1, so pip and other tools there never import torch for nothing).
SGLang's LoRA code asks for page-locked ("pinned") host memory unconditionally; a CPU-only torch
refuses that ("Found no NVIDIA driver"). Pinned memory only speeds up copies to a GPU, and on the
CPU there is none, so here it becomes ordinary memory. Nothing else is changed.
"""

from __future__ import annotations

import functools

import torch

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like", "as_tensor")


def _unpinned(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


if not torch.cuda.is_available():
    for _name in _FACTORIES:
        if hasattr(torch, _name):
            setattr(torch, _name, _unpinned(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
