"""Sessions and turn classification, so that stock clients train without patches.

A client that sends no session header still sends the whole conversation every time. Each
session keeps its *main line* as a hash chain (`session_chain.Chain`): the messages of its
last main turn plus the reply we gave. A request is matched on the longest prefix it shares
with any session of its user (one dict probe per message, however many sessions are open),
then classified against that session's line:

* **extend** — it continues the whole line: the messages after it are the next state of the
  line's last turn.
* **edited** — it continues the line but one of our replies in it reads differently: the agent
  merged two attempts, trimmed one, or replayed a tool call as text. Still the same
  conversation; the messages after the request's last reply are the next state, and the
  transition says the reply was edited.
* **resumed** — it shares no prefix with the line, but its last reply is the line's last reply
  and the client's turn follows it: the agent compacted the history before it (OpenClaw sends
  a summary, our last reply and the person's next message). The messages after that reply are
  its next state, as for extend; found by the line's resume key (`Chain.resume_key`). Without
  it every compaction began a new session and the turn before it lost its next state (a real
  OpenClaw day: 20 turns, 16 sessions).
* **fork** — it leaves the line at a user or tool message, or stops inside it: a regenerated
  reply, an edited question, or the real next message after a side request (a summary, a
  memory flush) that looked like a continuation. Turns whose replies lie past the fork are
  superseded, untrained.
* **new** / **none** — it shares no reply of ours with any session: a new conversation (or,
  on an explicit session, a side turn).

A next state is *provisional* until a later request of the session extends past it: a side
request that extends the line must not become the previous turn's next state for good, since
the real reply may still come (it forks, and replaces it). Transitions therefore reach the
judge one request later, or when the session closes.

State changes only when a reply is committed, so a request that fails or is aborted leaves no
trace. Explicit `X-Session-Id` / `X-Turn-Type` headers override inference. Sessions are keyed
by user, so one user's request can never land in, or read from, another user's session. With a
`SessionDB`, every change is persisted by `save()`, and a restart continues every open session.
`save()` writes a session's row beside the transitions it just handed to the judge, not after
them: the row keeps those until the judge's inbox has them on disk, and `resume()` hands them
over again after a crash (the inbox keeps a turn once), so a crash between the two loses neither.

With a shared `SessionDB` (PostgreSQL) every serving process holds copies of the sessions it
served lately, and the database has the newest: `refresh()` reads again, before a request is
classified, each candidate session another process changed since (one query when nothing did),
so a conversation whose requests alternate between processes stays one session with the same
transitions. Idle sessions are closed by whichever process claims them in the database
(`sweep_shared`), not by every process that held a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core

from nextstate.core.types import NextState, Transition, Turn
from nextstate.proxy.harness_turns import HarnessTurns
from nextstate.proxy.session_chain import Chain, MessageDigests, VolatileText, chain_step
from nextstate.core.stores.sessions import SessionDB, Write

# Where a session hands each transition (the judge's inbox). What it returns resolves once the
# transition is safe on disk, so the session may drop it from its row; None: kept at once.
TransitionSink = Callable[[Transition], Awaitable[None] | None]

TurnType = Literal["main", "side"]
# Session ids come back as the X-Session-Id header: visible ASCII only (no spaces, no control
# characters, nothing a header cannot carry), 1-200 characters.
SESSION_ID_PATTERN = r"^[\x21-\x7e]{1,200}$"
Match = Literal["extend", "edited", "resumed", "fork", "new", "none"]


@dataclass(eq=False)
class Session:
    id: str
    user: str
    explicit: bool
    last_active: float
    line: Chain | None = None  # the main line: the last main turn's request and our reply
    turn_count: int = 0
    pending: Turn | None = None  # the last main turn; its reply ends the line
    provisional: Transition | None = None  # the turn before, with a next state not yet confirmed
    provisional_at: int = -1  # index of that turn's reply in the line
    # The provisional transition went to the judge after the session settled (was quiet for
    # `settle_s`): confirming it sends nothing more; replacing it sends a revision.
    provisional_sent: bool = False
    closed: bool = False
    outcome_expected: bool = False  # its requests said an environment will post an outcome
    last_active_wall: float = field(default_factory=time.time)
    # Transitions handed to the judge and not yet in its inbox on disk: the row keeps them.
    handing: list[Transition] = field(default_factory=list)
    # Each turn's JSON text, by id (the turn is kept, so the id stays its own): see `to_json`.
    _encoded: dict[int, tuple[Turn, str]] = field(default_factory=dict, repr=False)
    # Shared sessions: the revision of this copy's last write (or of the row it was read from),
    # the last one the database confirmed, whether one was refused (another process wrote the
    # row first), and the line's hashes not yet in the database's index.
    rev: str | None = None
    written_rev: str | None = None
    conflicted: bool = False
    unindexed: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """The session's row, as JSON text, written on every request of an agent's
        conversation. Its turns carry the whole request and thousands of token ids and
        logprobs (~90 kB for OpenClaw): pydantic's encoder writes them ~5x faster than
        json.dumps (0.17 against 0.9 ms on the event loop), and each turn only once, since the
        turn pending now is the provisional one after the next request."""
        head = {
            "id": self.id, "user": self.user, "explicit": self.explicit, "last_active_wall": self.last_active_wall,
            "line": self.line.to_json() if self.line else None, "turn_count": self.turn_count,
            "provisional_at": self.provisional_at, "outcome_expected": self.outcome_expected,
            "provisional_sent": self.provisional_sent,
        }
        encoded, self._encoded = self._encoded, {}
        pending = self._turn_json(self.pending, encoded) if self.pending else "null"
        provisional = self._transition_json(self.provisional, encoded) if self.provisional else "null"
        handing = ",".join(self._transition_json(t, encoded) for t in self.handing)
        return (json.dumps(head, ensure_ascii=False)[:-1] + ',"pending":' + pending + ',"provisional":' + provisional
                + ',"handing":[' + handing + "]}")

    def _transition_json(self, transition: Transition, encoded: dict[int, tuple[Turn, str]]) -> str:
        rest = transition.model_dump_json(exclude={"turn"})  # '{"next_state":…}'
        return '{"turn":' + self._turn_json(transition.turn, encoded) + "," + rest[1:]

    def _turn_json(self, turn: Turn, encoded: dict[int, tuple[Turn, str]]) -> str:
        hit = encoded.get(id(turn))
        if hit is None or hit[0] is not turn:
            hit = (turn, _encode_turn(turn))
        self._encoded[id(turn)] = hit
        return hit[1]

    @classmethod
    def from_json(cls, data: dict[str, Any], clock_now: float) -> Session:
        idle = max(0.0, time.time() - data["last_active_wall"])
        return cls(
            id=data["id"], user=data["user"], explicit=data["explicit"], last_active=clock_now - idle,
            line=Chain.from_json(data["line"]) if data["line"] else None, turn_count=data["turn_count"],
            pending=Turn.model_validate(data["pending"]) if data["pending"] else None,
            provisional=Transition.model_validate(data["provisional"]) if data["provisional"] else None,
            provisional_at=data["provisional_at"], last_active_wall=data["last_active_wall"],
            provisional_sent=data.get("provisional_sent", False),
            outcome_expected=data.get("outcome_expected", False),
            handing=[Transition.model_validate(t) for t in data.get("handing", ())],
            rev=data.get("rev"), written_rev=data.get("rev"),
        )

    def write(self) -> Write:
        """This session's row as its next write, under a new revision."""
        prev, self.rev = self.rev, secrets.token_hex(8)
        hashes, self.unindexed = tuple(self.unindexed), []

        def done(written: bool, rev: str = self.rev) -> None:  # on the writer thread
            if written:
                self.written_rev = rev
            else:
                self.conflicted = True

        return Write(self.user, self.id, self.to_json(), self.rev, prev, self.last_active_wall, hashes, done)

    @property
    def writing(self) -> bool:
        """A write of this copy is on its way to the database: the copy is the newest."""
        return self.rev != self.written_rev and not self.conflicted


def _encode_turn(turn: Turn) -> str:
    if all(map(math.isfinite, turn.response_logprobs)):
        return turn.model_dump_json()
    # A -inf logprob as -Infinity, which json.loads reads back (pydantic's own dump writes null,
    # which would not validate); this table is read by Python alone, never by SQLite's JSON.
    return pydantic_core.to_json(turn.model_dump(), inf_nan_mode="constants").decode()


@dataclass
class TurnPlan:
    """How one request was classified, and what committing its reply will need."""

    session: Session | None
    turn_type: TurnType
    match: Match
    request: Chain
    messages: list[dict[str, Any]]
    turn_index: int | None = None
    close_after: bool = False
    harness: bool = False  # the agent's own request (a memory flush, a compaction summary)

    @property
    def session_id(self) -> str | None:
        return self.session.id if self.session else None


class SessionStore:
    def __init__(
        self,
        emit: TransitionSink,
        idle_s: float = 1800.0,
        settle_s: float = 0.0,
        max_sessions: int = 10000,
        clock: Callable[[], float] = time.monotonic,
        max_per_user: int | None = None,
        volatile: VolatileText | None = None,
        db: SessionDB | None = None,
        worker: str = "",
        rehand: TransitionSink | None = None,
        harness: HarnessTurns | None = None,
    ) -> None:
        """`rehand`: where transitions a row read back says were on their way go again (the
        judge's inbox, told it is a repeat; `emit` if not given)."""
        self._emit_to = emit
        self._rehand_to = rehand or emit
        self._handed: list[asyncio.Future[None]] = []  # what `emit` returned, until the judge has it on disk
        self._dirty: set[tuple[str, str]] = set()
        self.idle_s = idle_s
        self.settle_s = settle_s
        self.max_sessions = max_sessions
        self.max_per_user = max_per_user or max_sessions
        self._clock = clock
        self.digests = MessageDigests(volatile if volatile is not None else VolatileText())
        self._harness = harness or HarnessTurns()  # the agent's own requests: side turns
        self._db = db  # a SessionDB, or None to keep sessions in memory only
        self._sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()  # least recent first
        self._per_user: dict[str, OrderedDict[str, Session]] = {}  # the same, by user
        self._index: dict[str, Session] = {}  # chain hash (user-seeded) -> a session whose line has it
        # Shared: sessions are read when a request needs them, not all at start (every process
        # would hold every session); `worker` names this process in the closing leases.
        self.shared = db is not None and db.shared
        self.worker = worker or secrets.token_hex(6)
        if db is not None and not self.shared:
            for data in db.load():
                self._register(Session.from_json(data, self._clock()))

    def __len__(self) -> int:
        return len(self._sessions)

    def _emit(self, s: Session, transition: Transition, again: bool = False) -> None:
        handed = (self._rehand_to if again else self._emit_to)(transition)
        if inspect.isawaitable(handed):
            handed = asyncio.ensure_future(handed)
            s.handing.append(transition)
            handed.add_done_callback(lambda _: self._handed_over(s, transition))
            self._handed.append(handed)

    @staticmethod
    def _handed_over(s: Session, transition: Transition) -> None:
        """The judge has `transition` on disk: the session's next row leaves it out. Not
        rewritten for that alone: a row that still holds it is handed over again on restart,
        which the judge's inbox ignores."""
        with contextlib.suppress(ValueError):  # gone already (the session was forgotten)
            s.handing.remove(transition)

    def resume(self) -> int:
        """Hand the judge again what the sessions' rows say was on its way to it when the last
        run stopped (see `save`); its inbox keeps a turn once. Call once the judge runs."""
        resumed = 0
        for s in list(self._sessions.values()):
            handing, s.handing = s.handing, []
            for transition in handing:
                self._emit(s, transition, again=True)
                resumed += 1
        return resumed

    async def save(self, wait_s: float = 2.0) -> None:
        """Persist every session changed since the last save, and wait until the transitions
        handed to the judge are durable too (at most `wait_s`: a full disk must not hold a
        request). An open session's row is written at once, beside them: it carries those
        still on their way (`Session.handing`), and `resume` hands them over again after a
        crash. A closed session's row is deleted only once its last transitions are safe."""
        handed, self._handed = self._handed, []
        dirty, self._dirty = self._dirty, set()
        closed = [key for key in dirty if key not in self._sessions]
        rows = None
        if self._db is not None and len(closed) < len(dirty):
            for key in dirty:
                if (s := self._sessions.get(key)) is not None:
                    self._db.save(s.write())
            rows = asyncio.wrap_future(self._db.written())
        if handed:
            await asyncio.wait(handed, timeout=wait_s)
        if self._db is not None and closed:
            for key in closed:
                self._db.delete(*key)
            rows = asyncio.wrap_future(self._db.written())  # the writes queued before it, too
        if rows is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rows, wait_s)

    def chain(self, user: str, messages: list[dict[str, Any]]) -> Chain:
        return Chain.of(user, messages, self.digests)

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
        request: Chain | None = None,
    ) -> TurnPlan:
        """Classify a request (`request`: its chain, if made already); nothing changes until
        its reply is committed."""
        request = request if request is not None else self.chain(user, messages)
        harness = turn_type is None and self._harness.matches(messages)
        if harness:
            turn_type = "side"  # a memory flush or a compaction: never the person's reaction, never a session
        if session_id is not None:
            session = self._sessions.get((user, session_id)) or Session(session_id, user, True, self._clock())
            match = self._classify(session, request, messages)
        else:
            session, match = self._find(request, messages)
            if session is None and turn_type != "side":
                session, match = Session("sess_" + secrets.token_hex(12), user, False, self._clock()), "new"
        plan = TurnPlan(session, turn_type or ("main" if match != "none" else "side"), match, request, messages)
        plan.close_after = done
        plan.harness = harness
        if session is not None and plan.turn_type == "main":
            plan.turn_index = session.turn_count + 1
        return plan

    def _classify(self, s: Session, request: Chain, messages: list[dict[str, Any]] | None = None) -> Match:
        line = s.line
        if line is None or len(line) == 0:
            return "new"
        m, n = len(line), len(request)
        k = line.common_prefix(request)
        has_next = request.last_assistant() < n - 1  # a request must end with the client's turn
        if k == m and n > m:
            return "extend"
        if k < min(n, m) and request.roles[k] == "assistant" and line.roles[k] == "assistant" and has_next:
            return "edited"
        if messages is not None and has_next and self._only_user_message_rewritten(line, request, k, messages):
            return "edited"
        if has_next and k < m and line.reply is not None and request.reply == line.reply and line.roles[-1] == "assistant":
            return "resumed"
        if "assistant" in request.roles[:k] and has_next:
            return "fork"
        return "none"

    def _only_user_message_rewritten(self, line: Chain, request: Chain, k: int, messages: list[dict[str, Any]]) -> bool:
        """The request is the whole line with one user message (at `k`) reworded, and goes on
        past it. OpenClaw does this after an aborted reply: it sends the next message with the
        aborted one folded in (its "[Queued user message ...]" wrapper), and on the following
        turn rewrites that entry to the new message alone. Our reply to it is still the reply
        it got, so the conversation goes on (edited), instead of forking and dropping that turn.
        Checked by chaining the request's later messages onto the line's hash at `k`."""
        if not (k < len(line) - 1 and k < len(request) and line.roles[k] == "user" and request.roles[k] == "user"):
            return False
        if len(request) <= len(line) or request.roles[: len(line)] != line.roles:
            return False
        h = line.hashes[k]
        for j in range(k + 1, len(line)):
            digest = self.digests(messages[request.positions[j]])
            if digest is None:
                return False
            h = chain_step(h, digest)
            if h != line.hashes[j]:
                return False
        return True

    def _find(self, request: Chain, messages: list[dict[str, Any]]) -> tuple[Session | None, Match]:
        """The session sharing the longest prefix with the request (hashes are user-seeded)."""
        for k in range(len(request), 0, -1):
            session = self._index.get(request.hashes[k - 1])
            if session is not None:
                match = self._classify(session, request, messages)
                return (session, match) if match != "none" else (None, "none")
        if (key := request.resume_key) is not None and (session := self._index.get(key)) is not None:
            match = self._classify(session, request, messages)  # resumed (or, a one-turn line, edited)
            if match != "none":
                return session, match
        return None, "none"

    # ------------------------------------------------------------------ commit / close

    def commit_main(self, plan: TurnPlan, turn: Turn, reply: dict[str, Any]) -> Turn:
        """Record a finished main turn (classified again, against the session as it is now):
        the main line now ends with our reply. Returns the turn with its final index."""
        s = plan.session
        if s is None:
            return turn
        if s.closed:
            self._emit(s, Transition(turn=turn, next_state=None, reason="session_closed"))
            return turn
        if (s.user, s.id) not in self._sessions:
            self._register(s)
        match = self._classify(s, plan.request, plan.messages)
        old_keys = s.line.keys() if s.line else ()
        if match in ("extend", "edited", "resumed"):
            self._continue(s, plan, match)
        elif match == "fork":
            self._fork(s, plan)
        elif match == "none":  # an explicit main turn that does not continue its session's line
            self._confirm(s)
            self._supersede_pending(s)
        s.turn_count += 1
        s.outcome_expected = s.outcome_expected or turn.track == "outcome"
        if turn.turn_index != s.turn_count or turn.session_id != s.id:
            turn = turn.model_copy(update={"turn_index": s.turn_count, "session_id": s.id})
        s.line = plan.request.extended(reply, len(plan.messages), self.digests)
        s.pending = turn
        self._reindex(s, old_keys)
        if self.shared:
            known = set(old_keys)
            s.unindexed += [h for h in s.line.keys() if h not in known]
        self._touch(s)
        if plan.close_after:
            self.close(s)
        else:
            self._dirty.add((s.user, s.id))
        return turn

    def _continue(self, s: Session, plan: TurnPlan, match: Match) -> None:
        """The request goes on from the line (extend), from an edited reply in it (edited), or
        from its last reply after a compacted history (resumed): the last turn's next state is
        what follows the request's last reply, provisionally."""
        self._confirm(s)
        if s.pending is None:
            return
        request = plan.request
        start = len(s.line) if match == "extend" else request.last_assistant() + 1
        s.provisional = Transition(
            turn=s.pending, next_state=NextState(messages=_messages_from(plan, start)), reason="next_state",
            edited=match == "edited",
        )
        s.provisional_at = len(s.line) - 1
        s.pending = None

    def _fork(self, s: Session, plan: TurnPlan) -> None:
        """The request leaves the line at `k`: turns whose replies lie past it are superseded;
        the provisional turn before it gets the request's messages after its reply instead."""
        k = s.line.common_prefix(plan.request)
        if s.pending is not None and len(s.line) - 1 >= k:
            self._supersede_pending(s)
        if s.provisional is None:
            return
        sent = s.provisional_sent
        if s.provisional_at >= k:
            self._emit(s, Transition(turn=s.provisional.turn, next_state=None, reason="superseded", revises=sent))
            s.provisional, s.provisional_sent = None, False
            return
        replaced = _messages_from(plan, s.provisional_at + 1)
        if replaced and replaced != s.provisional.next_state.messages:
            s.provisional = Transition(turn=s.provisional.turn, next_state=NextState(messages=replaced), reason="next_state")
            if sent:  # the judge has the settled one: it judges this one instead, unless that turn trained
                self._emit(s, s.provisional.model_copy(update={"revises": True}))

    def _confirm(self, s: Session) -> None:
        if s.provisional is not None:
            if not s.provisional_sent:
                self._emit(s, s.provisional)
            s.provisional, s.provisional_sent = None, False

    def _supersede_pending(self, s: Session) -> None:
        if s.pending is not None:
            self._emit(s, Transition(turn=s.pending, next_state=None, reason="superseded"))
            s.pending = None

    def finish_side(self, plan: TurnPlan) -> None:
        if plan.close_after and plan.session is not None and not plan.session.closed:
            if (plan.session.user, plan.session.id) in self._sessions:
                self.close(plan.session)

    def close(self, s: Session, reason: Literal["session_closed"] = "session_closed") -> None:
        if s.closed:
            return
        s.closed = True
        self._unregister(s)
        self._confirm(s)
        if s.pending is not None:
            self._emit(s, Transition(turn=s.pending, next_state=None, reason=reason))
            s.pending = None
        self._dirty.add((s.user, s.id))

    def find_turn(self, user: str, response_id: str) -> Turn | None:
        """`user`'s turn that answered with `response_id`, if an open session still holds it
        (its last turn, or the one before whose next state is not yet confirmed)."""
        for s in self._per_user.get(user, {}).values():
            for turn in (s.pending, s.provisional.turn if s.provisional else None):
                if turn is not None and turn.response_id == response_id:
                    return turn
        return None

    def latest_pending(self, user: str) -> Turn | None:
        """`user`'s last main turn in their most recently active open session, if it awaits a
        next state: the conversation their next request most likely continues."""
        for s in reversed(self._per_user.get(user, {}).values()):
            if s.pending is not None:
                return s.pending
        return None

    def forget(self, user: str) -> int:
        """Drop every open session of `user` without handing anything to the judge."""
        dropped = 0
        for s in list(self._per_user.get(user, {}).values()):
            s.pending = s.provisional = None
            self.close(s)
            self._dirty.discard((s.user, s.id))
            dropped += 1
        if self._db is not None:
            self._db.forget(user)
        return dropped

    def sweep(self) -> int:
        """Close sessions idle for longer than idle_s, and hand the judge the provisional next
        state of those quiet for `settle_s`; returns how many sessions changed."""
        now = self._clock()
        deadline = now - self.idle_s
        changed = 0
        while self._sessions:
            s = next(iter(self._sessions.values()))
            if s.last_active > deadline:
                break
            self.close(s)
            changed += 1
        if self.settle_s > 0:
            settled = now - self.settle_s
            for s in self._sessions.values():  # least recently active first
                if s.last_active > settled:
                    break
                if s.provisional is not None and not s.provisional_sent:
                    self._settle(s)
                    changed += 1
        return changed

    def _settle(self, s: Session) -> None:
        """A closing reaction ("Thanks, that is fine.") has no later request to confirm it: once
        the session has been quiet for `settle_s`, the judge gets it. It stays provisional: a
        later request that replaces it sends a revision (judged instead, unless trained)."""
        assert s.provisional is not None
        self._emit(s, s.provisional)
        s.provisional_sent = True
        self._dirty.add((s.user, s.id))

    def close_all(self) -> None:
        for s in list(self._sessions.values()):
            self.close(s)

    # ------------------------------------------------------------------ shared (PostgreSQL)

    async def refresh(
        self, user: str, request: Chain | None = None, session_id: str | None = None, every: bool = False
    ) -> None:
        """Shared sessions: bring this process's copies of `user`'s sessions that `request` may
        continue (or `session_id`, or `every` one) up to the database's revision, reading those
        another process changed, and dropping those it closed. A copy whose own write is still
        on its way is the newest already. No-op for sessions of one process."""
        if not self.shared:
            return
        assert self._db is not None
        hashes = request.keys() if request is not None else ()
        copies = {s.id: s for h in hashes if (s := self._index.get(h)) is not None and s.user == user}
        if every:
            copies.update(self._per_user.get(user, {}))
        elif session_id is not None and (s := self.get(user, session_id)) is not None:
            copies[s.id] = s
        ids = set(copies) | ({session_id} if session_id is not None else set())
        # a copy whose write is on its way is the newest: whatever the database has, it matches
        known = {i: None if c.conflicted else c.rev for i, c in copies.items()}
        writing = {i for i, c in copies.items() if c.writing}
        revs, rows = await asyncio.to_thread(self._db.changed, user, hashes, ids, every, known)
        rows = [row for row in rows if row["id"] not in writing]
        for i, s in copies.items():
            if i not in revs and not s.writing:  # closed or forgotten by another process
                self._drop(s)
        for data in rows:
            self._adopt(data)

    def _adopt(self, data: dict[str, Any]) -> Session:
        """A session's row, read from the shared database, replacing this process's copy. What
        the row says was on its way to the judge is handed over again (the process that wrote it
        may have died first; the judge's inbox keeps a turn once)."""
        s = Session.from_json(data, self._clock())
        if (old := self.get(s.user, s.id)) is not None:
            self._drop(old)
        self._register(s)
        handing, s.handing = s.handing, []
        for transition in handing:
            self._emit(s, transition, again=True)
        return s

    async def sweep_shared(self) -> int:
        """`sweep` for shared sessions: copies idle here are dropped (another process may be
        serving the conversation), and the sessions idle in the database — served here or
        anywhere, even by a process that died — or beyond the caps on sessions (per user, and in
        all: a process evicts only its own copies) are closed by the one process that claims each.
        Settling (see `_settle`) happens only on a copy the database confirms is current."""
        assert self._db is not None
        now = self._clock()
        while self._sessions:
            s = next(iter(self._sessions.values()))
            if s.last_active > now - self.idle_s:
                break
            self._drop(s)
        claimed = await asyncio.to_thread(
            self._db.claim_idle, time.time() - self.idle_s, self.worker, self.max_per_user, self.max_sessions
        )
        for data in claimed:
            self.close(self._adopt(data))
        changed = len(claimed)
        if self.settle_s > 0:
            quiet = []
            for s in self._sessions.values():  # least recently active first
                if s.last_active > now - self.settle_s:
                    break
                if s.provisional is not None and not s.provisional_sent and not s.writing:
                    quiet.append(s)
            for s in quiet:
                revs = await asyncio.to_thread(self._db.revisions, s.user, (), (s.id,))
                if self._sessions.get((s.user, s.id)) is not s or s.provisional_sent:
                    continue
                if revs.get(s.id) != s.rev or s.conflicted:
                    self._drop(s)  # another process went on with it: read again when needed
                else:
                    self._settle(s)
                    changed += 1
        return changed

    # ------------------------------------------------------------------ bookkeeping

    def _register(self, s: Session) -> None:
        self._sessions[(s.user, s.id)] = s
        self._sessions.move_to_end((s.user, s.id))
        own = self._per_user.setdefault(s.user, OrderedDict())
        own[s.id] = s
        own.move_to_end(s.id)
        if s.line is not None:
            self._reindex(s, ())
        # Shared, only this process's copy goes: the session stays open in the database.
        evict = self._drop if self.shared else self.close
        while len(own) > self.max_per_user:  # a user's many sessions push out their own, not others'
            evict(next(iter(own.values())))
        while len(self._sessions) > self.max_sessions:
            # the user holding the most sessions gives up their least recent: one user opening
            # many never closes another's conversation while they hold more than that one does
            heaviest = max(self._per_user.values(), key=len)
            evict(next(iter(heaviest.values())))

    def _unregister(self, s: Session) -> None:
        self._sessions.pop((s.user, s.id), None)
        own = self._per_user.get(s.user)
        if own is not None:
            own.pop(s.id, None)
            if not own:
                del self._per_user[s.user]
        self._reindex(s, s.line.keys() if s.line else (), keep=False)

    def _drop(self, s: Session) -> None:
        """Forget this process's copy of a shared session, handing nothing to the judge."""
        if self._sessions.get((s.user, s.id)) is s:
            self._unregister(s)

    def _touch(self, s: Session) -> None:
        s.last_active = self._clock()
        s.last_active_wall = time.time()
        if (s.user, s.id) in self._sessions:
            self._sessions.move_to_end((s.user, s.id))
            self._per_user[s.user].move_to_end(s.id)

    def _reindex(self, s: Session, old: tuple[str, ...], keep: bool = True) -> None:
        """Point the index at `s` for every key of its line; drop its stale entries."""
        new = set(s.line.keys()) if keep and s.line else set()
        for h in old:
            if h not in new and self._index.get(h) is s:
                del self._index[h]
        for h in new:
            self._index[h] = s


def _messages_from(plan: TurnPlan, chain_index: int) -> list[dict[str, Any]]:
    """The request's messages from chain position `chain_index` on (volatile-only ones left
    out), up to the first assistant message: a next state is the user's and the tools' reaction
    to a reply, never a reply of ours (after an abort, OpenClaw's history put our superseded
    reply between two user messages, and the judge read it as the user's)."""
    out = []
    for i in plan.request.positions[chain_index:]:
        if plan.messages[i]["role"] == "assistant":
            break
        out.append(plan.messages[i])
    return out
