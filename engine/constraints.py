"""Grammar-constrained decoding for the embedded engine, with llguidance.

A forced tool call (`tool_choice` "required" or a named function) must come back as a call the
client can run, so its JSON is decoded under the call's JSON schema: before each sampled token,
the tokens the schema does not allow next are masked out, and once the JSON is complete only
end-of-turn is allowed.

Why llguidance (bench/grammar_backends.py, SmolLM2's 49k-token vocabulary, 2 CPU cores): it
installs as 8 MB with no dependencies and masks a token in ~0.09 ms (0.04 ms inside a string).
xgrammar masks in ~0.2 ms (0.02 ms in a string) but pulls in triton, 1 GB on a CPU machine;
outlines-core's guide is fast until nearly every token is allowed (inside a string): turning
its allowed-token list into a mask then costs ~6 ms per token, and its vocabulary wants tokens
as text, which byte-level BPE pieces are not. Turning a tokenizer into llguidance's form costs
~0.35 s once, which `warm()` pays at start-up, off the request path.

The mask is applied by unpacking llguidance's bitmask with plain torch ops (~0.1 ms for 49k
tokens), not with `llguidance.torch`'s kernel: that one is `torch.compile`d, so its first call
costs ~2.5 s, needs a C++ compiler on a CPU machine, starts compile worker processes, and
parses Python in a background thread (CPython 3.11's AST builder is not thread-safe,
gh-106905), all to save 0.05 ms per token next to a forward pass of tens of milliseconds.

JSON is laid out as Python's `json.dumps` does (", " and ": ", no other whitespace), the way
the tool-call examples in chat templates are written; unsupported schema keywords are ignored
rather than refused (lenient), so any tool a client declares can be forced.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import torch

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


class ConstraintError(ValueError):
    """The schema cannot be compiled, or the grammar engine cannot serve it (a 400)."""


# What a schema may ask of the grammar engine, checked before it is compiled so that the error
# names the construct. llguidance's own limits (LLParserLimits: 2,000 items in a row, 50,000
# items a step, 250,000 lexer states) stop what is past these mid-reply, with an error no client
# can act on: an anyOf of 5,000 objects, or a pattern "^a{1000000}$", failed after the first token.
MAX_BRANCHES = 256  # members of one anyOf / oneOf / allOf / enum
MAX_PATTERN_CHARS = 2_000
MAX_REPEAT = 10_000  # a {n} / {n,m} bound in a pattern
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def schema_limits(schema: Any, path: str = "#") -> str | None:
    """The first construct of `schema` past the limits above, by its JSON pointer; None if none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if (found := schema_limits(item, f"{path}/{i}")) is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf", "allOf", "enum"):
        if isinstance(schema.get(key), list) and len(schema[key]) > MAX_BRANCHES:
            return f"{path}/{key} has {len(schema[key])} members (at most {MAX_BRANCHES})"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        if len(pattern) > MAX_PATTERN_CHARS:
            return f"{path}/pattern is {len(pattern)} characters long (at most {MAX_PATTERN_CHARS})"
        for low, high in _REPEAT.findall(pattern):
            if max(int(low), int(high or 0)) > MAX_REPEAT:
                return f"{path}/pattern repeats {max(int(low), int(high or 0))} times (at most {MAX_REPEAT})"
    for key, value in schema.items():
        if isinstance(value, (dict, list)) and (found := schema_limits(value, f"{path}/{key}")) is not None:
            return found
    return None


def masked_logits(logits: torch.Tensor, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A float copy of `logits` ([rows]) keeping only the tokens set in llguidance's packed
    `bitmask` ([ceil(vocab / 32)] int32: bit i of word w is token 32w + i); rows past `vocab`
    (the model's padding) are never allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
    allowed[:vocab] = bits.flatten()[:vocab].bool()
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))


class JsonConstraint:
    """One generation's place in its schema: which tokens may come next."""

    def __init__(self, matcher: Any, tokenizer_vocab: int) -> None:
        import llguidance.torch as llt

        self._matcher = matcher
        self._vocab = tokenizer_vocab
        self._bitmask = llt.allocate_token_bitmask(1, tokenizer_vocab)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` ([vocab]) with the tokens the grammar forbids at -inf; rows the
        model has beyond the tokenizer's vocabulary (padding) are never allowed."""
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():  # a limit of the grammar engine was reached: nothing is allowed
            raise ConstraintError(f"the JSON schema cannot be served: {self._matcher.get_error()}")
        return masked_logits(logits, self._bitmask[0], self._vocab)

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ConstraintError(f"the JSON schema cannot be served: {self._matcher.get_error()}")


class ConstraintCompiler:
    """JSON schemas → `JsonConstraint`s over one model's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        self._model_dir = model_dir
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Index the tokenizer now (seconds, once) rather than in the first forced call."""
        with self._lock:
            if self._tokenizer is not None:
                return
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self._model_dir)
            tokenizer = llguidance.hf.from_tokenizer(hf)
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "boolean"}')
            JsonConstraint(llguidance.LLMatcher(tokenizer, grammar), tokenizer.vocab_size).apply(
                torch.zeros(tokenizer.vocab_size)
            )  # the first mask for a tokenizer builds its token trie
            self._tokenizer, self._vocab_size = tokenizer, tokenizer.vocab_size

    def compile(self, json_schema: str) -> JsonConstraint:
        import llguidance

        self.warm()
        schema = json.loads(json_schema)
        if (past := schema_limits(schema)) is not None:
            raise ConstraintError(f"the JSON schema asks more than the grammar engine serves: {past}")
        schema = {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}
        matcher = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        if matcher.is_error():
            raise ConstraintError(f"the tool's JSON schema cannot be used: {matcher.get_error()}")
        return JsonConstraint(matcher, self._vocab_size)
