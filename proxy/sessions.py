"""Sessions and turn classification, so that stock clients train without patches.

A client that sends no session header still sends the whole conversation every time. Each
session remembers a hash chain of its *main line*: the messages of its last main turn plus
the reply we gave. A request whose messages start with a session's main line continues that
session; the messages after the line are the next state of the previous turn. Looking a
request up costs one dict probe per message of the request, however many sessions are open.

Explicit `X-Session-Id` / `X-Turn-Type` headers override inference. Sessions are keyed by
user, so one user's request can never land in, or read from, another user's session.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from nextstate.types import NextState, Transition, Turn

TurnType = Literal["main", "side"]
Match = Literal["extend", "fork", "new", "none"]


def _canonical_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def message_digest(message: dict[str, Any]) -> str:
    """What identifies a message across round trips: clients may re-id tool calls, re-serialise
    arguments or trim whitespace, so none of those change the digest."""
    canonical: dict[str, Any] = {"role": message["role"], "content": (message.get("content") or "").strip()}
    if message.get("tool_calls"):
        canonical["tool_calls"] = [
            [c["function"]["name"], _canonical_arguments(c["function"].get("arguments"))] for c in message["tool_calls"]
        ]
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def chain_step(previous: str, digest: str) -> str:
    return hashlib.sha256((previous + digest).encode()).hexdigest()[:32]


def hash_chain(digests: list[str]) -> list[str]:
    out, h = [], ""
    for d in digests:
        h = chain_step(h, d)
        out.append(h)
    return out


@dataclass(eq=False)
class Session:
    id: str
    user: str
    explicit: bool
    last_active: float
    line_len: int = 0  # messages on the main line (request + our reply)
    line_hash: str = ""
    # The main line before the pending turn's request: lets a request that forks off there
    # (e.g. the real reply after a side request that looked like a continuation) be recognised.
    boundary_len: int = 0
    boundary_hash: str = ""
    turn_count: int = 0
    pending: Turn | None = None
    closed: bool = False


@dataclass
class TurnPlan:
    """How one request was classified, and what committing its reply will need."""

    session: Session | None
    turn_type: TurnType
    match: Match
    turn_index: int | None = None
    request_chain: list[str] = field(default_factory=list)
    close_after: bool = False

    @property
    def session_id(self) -> str | None:
        return self.session.id if self.session else None


class SessionStore:
    def __init__(
        self,
        emit: Callable[[Transition], None],
        idle_s: float = 1800.0,
        max_sessions: int = 10000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()  # least recent first
        self._by_line: dict[tuple[str, str], Session] = {}
        self._by_boundary: dict[tuple[str, str], Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, user: str, session_id: str) -> Session | None:
        return self._sessions.get((user, session_id))

    # ------------------------------------------------------------------ classification

    def resolve(
        self,
        user: str,
        messages: list[dict[str, Any]],
        session_id: str | None = None,
        turn_type: TurnType | None = None,
        done: bool = False,
    ) -> TurnPlan:
        chain = hash_chain([message_digest(m) for m in messages])
        if session_id is not None:
            session = self._sessions.get((user, session_id)) or self._open(user, session_id, explicit=True)
            match = self._match_explicit(session, chain)
        else:
            session, match = self._match_inferred(user, chain)
            if session is None and turn_type != "side":
                session, match = self._open(user, "sess_" + secrets.token_hex(12), explicit=False), "new"
        plan = TurnPlan(session, turn_type or ("main" if match != "none" else "side"), match, request_chain=chain)
        plan.close_after = done
        if session is None:
            return plan
        self._touch(session)
        if plan.turn_type == "main":
            self._begin_main(session, match, messages)
            session.turn_count += 1
            plan.turn_index = session.turn_count
        return plan

    def _match_explicit(self, s: Session, chain: list[str]) -> Match:
        n = len(chain)
        if s.line_len == 0:
            return "new" if s.turn_count == 0 else "extend"
        if s.line_len < n and chain[s.line_len - 1] == s.line_hash:
            return "extend"
        if s.pending is not None and s.boundary_len < n and (s.boundary_len == 0 or chain[s.boundary_len - 1] == s.boundary_hash):
            return "fork"
        return "none"

    def _match_inferred(self, user: str, chain: list[str]) -> tuple[Session | None, Match]:
        # The longest main line the request continues wins; a strict prefix is required, since
        # a continuation always adds at least the user's reply or a tool result.
        for k in range(len(chain) - 1, 0, -1):
            key = (user, chain[k - 1])
            if (s := self._by_line.get(key)) is not None:
                return s, "extend"
            if (s := self._by_boundary.get(key)) is not None and s.pending is not None:
                return s, "fork"
        return None, "none"

    def _begin_main(self, s: Session, match: Match, messages: list[dict[str, Any]]) -> None:
        if match == "extend":
            if s.pending is not None:
                self._emit(Transition(turn=s.pending, next_state=NextState(messages=messages[s.line_len :]), reason="next_state"))
                s.pending = None
        elif match == "fork":
            # The pending turn was not on the main line after all (a side request that looked
            # like a continuation, or a regenerated reply): drop it untrained.
            s.pending = None
            self._set_line(s, s.boundary_len, s.boundary_hash)
        elif match == "none" and s.pending is not None:
            self._emit(Transition(turn=s.pending, next_state=None, reason="superseded"))
            s.pending = None

    # ------------------------------------------------------------------ commit / close

    def commit_main(self, plan: TurnPlan, turn: Turn, reply: dict[str, Any]) -> None:
        """Record a finished main turn: the main line now ends with our reply."""
        s = plan.session
        if s is None:
            return
        if s.closed:
            self._emit(Transition(turn=turn, next_state=None, reason="session_closed"))
            return
        base_len, base_hash = s.line_len, s.line_hash
        request_hash = plan.request_chain[-1] if plan.request_chain else ""
        self._set_line(s, len(plan.request_chain) + 1, chain_step(request_hash, message_digest(reply)))
        self._set_boundary(s, base_len, base_hash)
        s.pending = turn
        self._touch(s)
        if plan.close_after:
            self.close(s)

    def finish_side(self, plan: TurnPlan) -> None:
        if plan.close_after and plan.session is not None and not plan.session.closed:
            self.close(plan.session)

    def close(self, s: Session, reason: Literal["session_closed"] = "session_closed") -> None:
        if s.closed:
            return
        s.closed = True
        self._sessions.pop((s.user, s.id), None)
        self._set_line(s, 0, "")
        self._set_boundary(s, 0, "")
        if s.pending is not None:
            self._emit(Transition(turn=s.pending, next_state=None, reason=reason))
            s.pending = None

    def sweep(self) -> int:
        """Close sessions idle for longer than idle_s; returns how many closed."""
        deadline = self._clock() - self.idle_s
        closed = 0
        while self._sessions:
            s = next(iter(self._sessions.values()))
            if s.last_active > deadline:
                break
            self.close(s)
            closed += 1
        return closed

    def close_all(self) -> None:
        for s in list(self._sessions.values()):
            self.close(s)

    # ------------------------------------------------------------------ bookkeeping

    def _open(self, user: str, session_id: str, explicit: bool) -> Session:
        s = Session(id=session_id, user=user, explicit=explicit, last_active=self._clock())
        self._sessions[(user, session_id)] = s
        while len(self._sessions) > self.max_sessions:
            self.close(next(iter(self._sessions.values())))
        return s

    def _touch(self, s: Session) -> None:
        s.last_active = self._clock()
        if (s.user, s.id) in self._sessions:
            self._sessions.move_to_end((s.user, s.id))

    def _set_line(self, s: Session, length: int, digest: str) -> None:
        self._reindex(self._by_line, s, (s.line_len, s.line_hash), (length, digest))
        s.line_len, s.line_hash = length, digest

    def _set_boundary(self, s: Session, length: int, digest: str) -> None:
        self._reindex(self._by_boundary, s, (s.boundary_len, s.boundary_hash), (length, digest))
        s.boundary_len, s.boundary_hash = length, digest

    @staticmethod
    def _reindex(index: dict, s: Session, old: tuple[int, str], new: tuple[int, str]) -> None:
        """Move `s` in a hash index from its old line to its new one (length 0 = no line)."""
        if old[0] and index.get((s.user, old[1])) is s:
            del index[(s.user, old[1])]
        if new[0]:
            index[(s.user, new[1])] = s
