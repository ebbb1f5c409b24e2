"""Token ids → text deltas for streaming, honouring stop strings.

Decoding token by token breaks multi-byte characters and merges (byte-level BPE), so a delta
is released only once it no longer ends in a partial character. With a fast tokenizer that is
`tokenizers`' own `DecodeStream`; a slow (Python) tokenizer decodes a short window twice per
token instead. Text that might be the start of a stop string is held back until it is clear.
"""

from __future__ import annotations

from typing import Any


def incremental_detokenizer(tokenizer: Any, skip_ids: tuple[int, ...] = ()) -> StreamDetokenizer | WindowDetokenizer:
    """The fastest detokenizer this tokenizer supports; both have `push(id) -> str` and `flush()`."""
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        return StreamDetokenizer(tokenizer, skip_ids)
    return WindowDetokenizer(tokenizer, skip_ids)


class StreamDetokenizer:
    """`tokenizers.decoders.DecodeStream` (Rust), several times cheaper per token than window decoding (1 µs against 4 µs on SmolLM2's tokenizer here)."""

    def __init__(self, tokenizer: Any, skip_ids: tuple[int, ...] = ()) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._skip = set(skip_ids)
        self._ids: list[int] = []
        self._emitted = 0  # characters released so far

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        text = self._stream.step(self._backend, token_id)
        if not text:
            return ""
        self._emitted += len(text)
        return text

    def flush(self) -> str:
        """Whatever is still held back at the end, partial characters included."""
        whole = self._tok.decode(self._ids, skip_special_tokens=True)
        rest = whole[self._emitted :]
        self._emitted = len(whole)
        return rest


class WindowDetokenizer:
    """Decodes the tokens since the last released delta, with the one before as context."""

    def __init__(self, tokenizer: Any, skip_ids: tuple[int, ...] = ()) -> None:
        self._tok = tokenizer
        self._skip = set(skip_ids)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end, partial characters included."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopStringMatcher:
    """Cuts the text at the first stop string; the stop string itself is not returned."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        if self.stopped or not self._stops:
            return "" if self.stopped else text
        buf = self._held + text
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda pair: pair[0])
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = 0  # longest tail of buf that could still grow into a stop string
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), keep, -1):
                if stop.startswith(buf[-n:]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
