"""Prompt text to token ids piece by piece, with the pieces seen before taken from a cache, and
a person's replies as the ids they were sampled as (`PromptEncoder.remember`).

A conversation's prompt grows by a message or two per turn, and an agent's is thousands of
tokens (OpenClaw's system prompt and tools alone are ~3.8k). Byte-level BPE over all of it
again was most of a request's rendering: 0.6 of 0.8 ms for a 20-message chat on the tiny
model, several ms for an agent's prompt, on every request, the judge's and teacher's
re-renders included.

Why a piece can be encoded alone and give the same ids: a `tokenizers` tokenizer splits the
text at its added tokens (<|im_start|>, <|im_end|>, ...) before normalising, pre-tokenising or
merging anything, so no token ever spans one. Starting a piece at every special token (each
chat-template message opens with one) therefore changes nothing, as long as those tokens strip
no whitespace around themselves (lstrip, rstrip, single_word off) and are matched on the raw
text (normalized off). Tokenizers for which that cannot be checked fall back to encoding the
whole text; tests/test_prompt_encoder.py compares both on the test models.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from nextstate.core.lru import SizedLRU

DEFAULT_MAX_CACHED_TOKENS = 500_000  # ~20 MB of Python ints at most: a hundred agents' conversations


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # fast (Rust) tokenizers only
        self._added = _piece_start(tokenizer) if self._backend is not None and max_cached_tokens > 0 else None
        self._cache: SizedLRU[str, list[int]] = SizedLRU(max_cached_tokens, lambda piece, ids: len(ids))
        self._lock = threading.Lock()  # prompts are rendered in worker threads
        self._special_ids = frozenset(tokenizer.convert_tokens_to_ids(list(self._added[1]))) if self._added else frozenset()
        # (owner, piece) -> the ids a reply was sampled as: kept per person, so that no one's
        # prompt is encoded by what the model wrote for someone else (nor its length tells it)
        self._replies: SizedLRU[tuple[str, str], list[int]] = SizedLRU(max_cached_tokens, lambda key, ids: len(ids))

    @property
    def piecewise(self) -> bool:
        """False: this tokenizer's text is encoded whole, nothing cached."""
        return self._added is not None

    @property
    def cached_pieces(self) -> int:
        return len(self._cache)

    @property
    def cached_tokens(self) -> int:
        return self._cache.total

    def encode(self, text: str, owner: str | None = None) -> list[int]:
        """`text`'s ids; `owner`'s replies as they were sampled (`remember`)."""
        if self._added is None:
            return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        pattern, special = self._added
        starts = [m.start() for m in pattern.finditer(text) if m.start() > 0 and m.group() in special]
        pieces = [text[a:b] for a, b in zip([0, *starts], [*starts, len(text)])]
        found: dict[str, list[int]] = {}
        with self._lock:
            for piece in pieces:
                ids = self._replies.get((owner, piece)) if owner is not None else None
                if ids is None:
                    ids = self._cache.get(piece)
                if ids is not None:
                    found[piece] = ids
        missing = list(dict.fromkeys(p for p in pieces if p not in found))
        if missing:
            encoded = self._backend.encode_batch(missing, add_special_tokens=False)
            with self._lock:
                for piece, enc in zip(missing, encoded):
                    found[piece] = enc.ids
                    self._cache.put(piece, enc.ids)
        return [i for piece in pieces for i in found[piece]]

    def remember(self, owner: str, prompt_ids: list[int], reply_ids: list[int]) -> bool:
        """The reply as sampled becomes the encoding of its text wherever a later prompt of
        `owner`'s holds it as the piece it was sampled into (the prompt's last piece, the
        generation prompt, and the reply up to its stop token). True if remembered.

        A sampled reply is often not the tokenizer's own encoding of its text (a run of spaces
        split otherwise, a word in two pieces): 1 of 3 256-token OpenClaw replies in
        bench.update_speed's capture. Encoded anew, the next turn's prompt then departs from the
        ids the model actually produced: the engine's kept prefix stops there, and the learner
        can no longer read that turn's sample inside the next one's row (learner/micro_batches.py)
        — a pass computed two rows where one held all four samples. Given the ids it sampled, the
        model sees its own words as it wrote them."""
        if self._added is None:
            return False
        start = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] in self._special_ids), None)
        end = next((i for i, t in enumerate(reply_ids) if t in self._special_ids), len(reply_ids))
        if start is None or end == 0:
            return False
        head, reply = prompt_ids[start:], list(reply_ids[:end])
        decode = self._backend.decode
        head_text = decode(head, skip_special_tokens=False)
        if self.encode(head_text) != head:  # a tokenizer whose text does not come back from its ids as it went in
            return False
        text = head_text + decode(reply, skip_special_tokens=False)
        if "\ufffd" in text[len(head_text):]:  # a character cut in two: no client holds this text
            return False
        with self._lock:
            self._replies.discard((owner, text))  # the same words sampled again: the latest ids
            self._replies.put((owner, text), head + reply)
        return True

    def forget(self, owner: str) -> int:
        """Drop `owner`'s remembered replies (their text is the person's data); how many."""
        with self._lock:
            keys = [k for k in self._replies.keys() if k[0] == owner]
            for key in keys:
                self._replies.discard(key)
        return len(keys)


def _piece_start(tokenizer: Any) -> tuple[re.Pattern[str], frozenset[str]] | None:
    """The tokenizer's added tokens, matched the way it matches them (leftmost, then longest),
    and the special ones among them, before which a piece starts. None when any added token
    could make a piece's ids differ from the whole text's."""
    added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    special = frozenset(t.content for t in added if t.special)
    if not special:
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in contents)), special
