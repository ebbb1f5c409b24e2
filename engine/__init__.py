"""Model execution behind one interface (`Engine`), whatever runs the model.

`local` runs a transformers + peft model in-process; it is the embedded default and what the
tests use. `sglang` drives an SGLang server over its native HTTP API and `vllm` a vLLM server
over its OpenAI-compatible one, for GPUs (engine/remote.py has what the two share). The proxy
only ever talks to the `Engine` protocol, with token ids in and token ids out, so the tokens it
records for training are exactly the tokens that were sampled.
"""

from nextstate.engine.base import (
    Engine,
    EngineBadGateway,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    GeneratedToken,
    SamplingParams,
    UnknownAdapterError,
)

__all__ = [
    "Engine",
    "EngineBadGateway",
    "EngineError",
    "EngineTimeout",
    "EngineUnavailable",
    "GeneratedToken",
    "SamplingParams",
    "UnknownAdapterError",
]
