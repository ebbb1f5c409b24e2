"""Model execution behind one interface (`Engine`), whatever runs the model.

`local` runs a transformers + peft model in-process; it is the embedded default and what the
tests use. The proxy only ever talks to the `Engine` protocol, with token ids in and token ids
out, so the tokens it records for training are exactly the tokens that were sampled.
"""

from engine.base import Engine, EngineError, GeneratedToken, SamplingParams, UnknownAdapterError

__all__ = ["Engine", "EngineError", "GeneratedToken", "SamplingParams", "UnknownAdapterError"]
