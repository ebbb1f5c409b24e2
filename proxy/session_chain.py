"""What identifies a conversation across requests: normalised message digests in a hash chain.

A client sends the whole conversation on every request, and the same conversation should
produce the same chain however the client re-serialises it. Digests therefore ignore what
clients change without changing the conversation: tool-call ids, the JSON formatting of
arguments, surrounding whitespace, and volatile text such as the timestamp an agent puts in
front of each user message (`VolatileText`, configurable, OpenClaw's patterns by default). A
message that is nothing but volatile text (a runtime-context block an agent appends to every
request) is left out of the chain altogether, and so are system messages: agents rewrite
their system prompt within one conversation (a new date; OpenClaw drops tools from it after a
context overflow), while the turns of the conversation stay what they were.

The chain is seeded with the user, so equal conversations of two users never share a hash.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nextstate.core.lru import SizedLRU
from nextstate.core.agent_texts import VOLATILE_PATTERNS

class VolatileText:
    """Removes text that changes between requests of one conversation, for matching only."""

    def __init__(self, patterns: Iterable[str] = VOLATILE_PATTERNS) -> None:
        self.patterns = [re.compile(p) for p in patterns]

    def __call__(self, text: str) -> str:
        for pattern in self.patterns:
            text = pattern.sub("", text)
        return text.strip()


def _canonical_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def message_digest(message: dict[str, Any], volatile: VolatileText | None = None) -> str | None:
    """The message's identity across round trips; None for a message with nothing but volatile
    text in it (it does not count as part of the conversation)."""
    content = (message.get("content") or "").strip()
    if volatile is not None:
        content = volatile(content)
    calls = message.get("tool_calls")
    if not content and not calls and message["role"] != "assistant" and volatile is not None and message.get("content"):
        return None
    canonical: dict[str, Any] = {"role": message["role"], "content": content}
    if calls:
        canonical["tool_calls"] = [[c["function"]["name"], _canonical_arguments(c["function"].get("arguments"))] for c in calls]
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class MessageDigests:
    """`message_digest` with `volatile`, remembered. An agent sends its whole conversation on
    every request, so all but the newest messages were digested before: OpenClaw's 23-message
    request cost 0.3 ms of the event loop in regexes, JSON and SHA-256 (more every turn),
    against a dict probe per message. Remembered by role and content, at most `max_chars`
    characters of content (least recently used out first); messages with tool calls are
    digested each time (their arguments are canonicalised, a dict key is no shortcut)."""

    def __init__(self, volatile: VolatileText, max_chars: int = 4_000_000) -> None:
        self.volatile = volatile
        self._known: SizedLRU[tuple[str, str], str | None] = SizedLRU(max_chars, lambda key, digest: len(key[1]))

    def __call__(self, message: dict[str, Any]) -> str | None:
        content = message.get("content")
        if message.get("tool_calls") or not isinstance(content, str):
            return message_digest(message, self.volatile)
        key = (message["role"], content)
        digest = self._known.get(key, _UNKNOWN)
        if digest is _UNKNOWN:
            digest = message_digest(message, self.volatile)
            self._known.put(key, digest)
        return digest


_UNKNOWN: Any = object()  # None is a digest too (a volatile-only message)


def chain_step(previous: str, digest: str) -> str:
    return hashlib.sha256((previous + digest).encode()).hexdigest()[:32]


def chain_seed(user: str) -> str:
    return hashlib.sha256(b"nextstate-session\0" + user.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Chain:
    """A conversation as a session sees it: for each counted message, its index in the
    request, its role, and the chain hash of everything up to and including it."""

    seed: str
    hashes: tuple[str, ...]
    roles: tuple[str, ...]
    positions: tuple[int, ...]  # index in the request's message list
    reply: str | None = None  # the digest of its last assistant message (see `resume_key`)

    def __len__(self) -> int:
        return len(self.hashes)

    @classmethod
    def of(cls, user: str, messages: Sequence[dict[str, Any]], digests: MessageDigests | None = None) -> Chain:
        hashes, roles, positions = [], [], []
        h = seed = chain_seed(user)
        reply = None
        for i, message in enumerate(messages):
            if message["role"] == "system":
                continue
            digest = digests(message) if digests is not None else message_digest(message)
            if digest is None:
                continue
            h = chain_step(h, digest)
            hashes.append(h)
            roles.append(message["role"])
            positions.append(i)
            if message["role"] == "assistant":
                reply = digest
        return cls(seed, tuple(hashes), tuple(roles), tuple(positions), reply)

    def extended(self, message: dict[str, Any], position: int, digests: MessageDigests | None = None) -> Chain:
        """This chain with one more message (our reply, at `position`) at the end."""
        digest = (digests(message) if digests is not None else None) or message_digest(message)
        last = self.hashes[-1] if self.hashes else self.seed
        return Chain(
            self.seed, self.hashes + (chain_step(last, digest),), self.roles + (message["role"],), self.positions + (position,),
            digest if message["role"] == "assistant" else self.reply,
        )

    @property
    def resume_key(self) -> str | None:
        """A key for the chain's last reply alone, whatever came before it (user-seeded, like the
        hashes). An agent that compacts its history sends the summary, our last reply and the
        person's next message: no prefix of the session's line is left, but that reply is, and
        the message after it is still the person's reaction to it (`SessionStore._classify`)."""
        return chain_step(self.seed, "reply\0" + self.reply) if self.reply is not None else None

    def keys(self) -> tuple[str, ...]:
        """What a session on this line is found by: its prefix hashes and its resume key."""
        key = self.resume_key
        return self.hashes + ((key,) if key is not None else ())

    def last_assistant(self) -> int:
        """Index of the last assistant message, -1 if there is none."""
        for i in range(len(self.roles) - 1, -1, -1):
            if self.roles[i] == "assistant":
                return i
        return -1

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "hashes": list(self.hashes), "roles": list(self.roles), "positions": list(self.positions),
                "reply": self.reply}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Chain:
        # rows written before the resume key have no "reply": such a line is found by prefix only
        return cls(data["seed"], tuple(data["hashes"]), tuple(data["roles"]), tuple(data["positions"]), data.get("reply"))

    def common_prefix(self, other: Chain) -> int:
        """How many leading messages the two chains share (equal hashes mean equal prefixes)."""
        lo, hi = 0, min(len(self), len(other))
        while lo < hi:  # hashes are prefix-closed: binary search for the last equal one
            mid = (lo + hi + 1) // 2
            if self.hashes[mid - 1] == other.hashes[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo
