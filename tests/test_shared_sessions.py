"""Sessions shared by several serving processes through PostgreSQL: a conversation whose
requests alternate between processes is one session with the transitions one process would
produce; idle sessions close once, whoever served them, even after their process died.

Each "process" here is a SessionStore with its own SessionDB (its own connection), on a real
PostgreSQL (tests/real_engines/postgres_server.py); the servers' own alternation is in
test_engine_replicas.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from nextstate.core.types import Transition
from nextstate.core.stores import sessions as session_db_module
from nextstate.core.stores.sessions import SessionDB
from nextstate.proxy.sessions import SessionStore
from tests.test_sessions import SYS, make_turn, reply, user

pytestmark = pytest.mark.distributed


@pytest.fixture
def shared_url(postgres) -> str:
    return postgres.fresh_database(f"s{uuid.uuid4().hex[:12]}")


@pytest.fixture
def processes(tmp_path, shared_url):
    """`processes(name, **store_settings)` opens one more process on the shared database; all
    hand their transitions to `processes.emitted`, and all are closed after the test."""
    opened: list[Process] = []

    def open_process(name: str, **kwargs) -> Process:
        opened.append(Process(shared_url, tmp_path / f"{name}.sqlite3", open_process.emitted, name, **kwargs))
        return opened[-1]

    open_process.emitted = []
    yield open_process
    for process in opened:
        process.close()


class Process:
    """One serving process's session store, driven as proxy/turns.py drives it."""

    def __init__(self, url: str | None, path, emitted: list[Transition], name: str, **kwargs) -> None:
        self.now = 0.0
        self.db = SessionDB(path, url)
        self.store = SessionStore(emitted.append, clock=lambda: self.now, db=self.db, worker=name, **kwargs)

    async def turn(self, who: str, messages: list[dict], answer: str, session_id: str | None = None):
        chain = self.store.chain(who, messages)
        await self.store.refresh(who, chain, session_id)
        plan = self.store.resolve(who, messages, session_id=session_id, request=chain)
        if plan.turn_type == "main":
            self.store.commit_main(plan, make_turn(plan, messages), reply(answer))
        await self.store.save()
        return plan

    def close(self) -> None:
        self.db.close()


async def alternated(processes) -> tuple[Process, Process, list[tuple[list[dict], str]]]:
    """Processes a and b, alice's first turn taken by a and her second by b; her three steps."""
    a, b, steps = processes("a"), processes("b"), conversation(3)
    await a.turn("alice", *steps[0])
    await b.turn("alice", *steps[1])
    return a, b, steps


def conversation(n: int) -> list[tuple[list[dict], str]]:
    """An agent's n requests, each the whole conversation so far, with the reply each gets."""
    steps, messages = [], [SYS, user("q1")]
    for i in range(1, n + 1):
        steps.append((list(messages), f"a{i}"))
        messages += [reply(f"a{i}"), user(f"q{i + 1}")]
    return steps


def summary(emitted: list[Transition]) -> list[tuple]:
    return sorted((t.turn.turn_index, t.reason, t.next_state.messages if t.next_state else None) for t in emitted)


def test_a_conversation_alternating_between_processes_is_one_session(processes, tmp_path):
    one: list[Transition] = []
    alone = Process(None, tmp_path / "one.sqlite3", one, "alone")  # one process, its SQLite file
    both = processes.emitted

    async def scenario():
        a, b = processes("a"), processes("b")
        ids = set()
        for i, (messages, answer) in enumerate(conversation(6)):
            await alone.turn("alice", messages, answer)
            plan = await (a if i % 2 == 0 else b).turn("alice", messages, answer)
            ids.add(plan.session_id)
            assert plan.match == ("new" if i == 0 else "extend") and plan.turn_index == i + 1
        assert len(ids) == 1, "one session, whichever process took each request"
        # an explicit session id alternates too
        for i, (messages, answer) in enumerate(conversation(3)):
            plan = await (b if i % 2 == 0 else a).turn("bob", messages, answer, session_id="agent-7")
            assert plan.turn_index == i + 1

    asyncio.run(scenario())
    alone.close()
    alice = [t for t in both if t.turn.user == "alice"]
    assert summary(alice)[:4] == summary(one)[:4], "the same confirmed transitions as one process gave"
    assert len(alice) == 4, "turns 1-4 confirmed; 5 provisional and 6 pending stay in the open session"
    bob = [t for t in both if t.turn.user == "bob"]
    assert [(t.turn.turn_index, t.turn.session_id) for t in bob] == [(1, "agent-7")]


def test_idle_sessions_close_once_even_when_their_process_died(processes):
    async def scenario():
        emitted = processes.emitted
        a = processes("a", idle_s=0.2)
        b = processes("b", idle_s=0.2)
        c = processes("c", idle_s=0.2)
        steps = conversation(3)
        for i, (messages, answer) in enumerate(steps):
            await (a if i % 2 == 0 else b).turn("alice", messages, answer)
        await c.turn("carol", *steps[0])
        assert summary(emitted) == [(1, "next_state", [user("q2")])]
        # a and b both hold copies; c, which served carol, dies (never closed, never swept)
        c.close()
        await asyncio.sleep(0.3)
        changed = await asyncio.gather(a.store.sweep_shared(), b.store.sweep_shared())
        await asyncio.gather(a.store.save(), b.store.save())
        assert sum(changed) == 2, "alice's and carol's sessions, each closed by one process"
        a.db.flush()
        b.db.flush()
        assert list(a.db.load()) == [], "closed sessions are gone from the database"
        return emitted

    emitted = asyncio.run(scenario())
    assert summary(emitted) == [
        (1, "next_state", [user("q2")]), (1, "session_closed", None),
        (2, "next_state", [user("q3")]), (3, "session_closed", None),
    ]
    assert [t.turn.user for t in emitted if t.turn.turn_index == 1 and t.reason == "session_closed"] == ["carol"]


def test_a_closer_that_dies_leaves_the_session_to_the_next(processes, monkeypatch):
    monkeypatch.setattr(session_db_module, "CLOSE_LEASE_S", 0.2)

    async def scenario():
        emitted = processes.emitted
        a = processes("a", idle_s=0.01)
        await a.turn("alice", *conversation(1)[0])
        await asyncio.sleep(0.05)
        claimed = a.db.claim_idle(time.time(), "dead")  # claimed, never closed
        assert len(claimed) == 1
        b = processes("b", idle_s=0.01)
        assert await b.store.sweep_shared() == 0, "the dead closer's lease still runs"
        await asyncio.sleep(0.3)
        assert await b.store.sweep_shared() == 1
        await b.store.save()
        return emitted

    emitted = asyncio.run(scenario())
    assert summary(emitted) == [(1, "session_closed", None)]


def test_a_copy_behind_the_database_never_overwrites_it(processes):
    async def scenario():
        emitted = processes.emitted
        a, b, steps = await alternated(processes)
        # a commits on its stale copy without reading the database first (as two processes
        # committing one conversation's turns at the same moment would): its write is refused
        stale = a.store.resolve("alice", steps[1][0])
        a.store.commit_main(stale, make_turn(stale, steps[1][0]), reply("other"))
        await a.store.save()
        a.db.flush()
        assert a.store.get("alice", stale.session_id).conflicted
        plan = await a.turn("alice", *steps[2])  # a reads the row b wrote, and goes on from it
        assert (plan.match, plan.turn_index) == ("extend", 3)
        assert plan.session.provisional.turn.turn_index == 2
        assert plan.session.provisional.next_state.messages == [user("q3")]
        return emitted

    emitted = asyncio.run(scenario())
    assert summary(emitted) == [(1, "next_state", [user("q2")])]


def test_forgetting_a_user_in_one_process_reaches_the_others(processes):
    async def scenario():
        emitted = processes.emitted
        a, b, steps = await alternated(processes)
        await a.store.refresh("alice", every=True)
        assert a.store.forget("alice") == 1
        await a.store.save()
        a.db.flush()
        plan = await b.turn("alice", *steps[2])
        assert plan.match == "new", "b's copy went with the rows"
        return emitted

    emitted = asyncio.run(scenario())
    assert summary(emitted) == [], "nothing of a forgotten user's goes to the judge"


def test_two_servers_on_one_database_serve_one_conversation_as_one_session(server_factory, postgres):
    """A stock client (no session header) whose requests alternate between two nextstate
    processes on one PostgreSQL: one session, numbered turns, each next state handed to the
    judge's inbox once — and a rating of a turn still open in the other process's session."""
    from nextstate.core.stores.samples import SampleStore
    from tests.test_feedback import rate

    url = postgres.fresh_database(f"h{uuid.uuid4().hex[:12]}")
    a, b = (server_factory(database_url=url, judge_enabled=False) for _ in range(2))
    key = a.key("alice")  # one key store: made on a, known to b
    messages = [{"role": "user", "content": "Name a colour."}]
    sessions, replies = set(), []
    for i in range(4):
        raw = (a if i % 2 == 0 else b).client(key).chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4, temperature=0.0)
        reply_ = raw.parse()
        sessions.add(raw.headers["x-session-id"])
        replies.append(reply_.id)
        messages += [{"role": "assistant", "content": reply_.choices[0].message.content},
                     {"role": "user", "content": f"And another ({i})."}]
    assert len(sessions) == 1
    # the last reply (b's) is a turn still open in the session, which a's copy has not seen
    assert rate(a, key, replies[-1], 1).status_code == 200
    store = SampleStore(a.settings.data_dir / "unused.sqlite3", url)
    try:
        rows = store._db.execute('SELECT data FROM transitions WHERE "user" = ?', ("alice",)).fetchall()
        got = sorted((Transition.model_validate_json(data).turn.turn_index, Transition.model_validate_json(data).turn.session_id)
                     for (data,) in rows)
        assert got == [(1, *sessions), (2, *sessions)], "turns 1 and 2 confirmed once each; 3 and 4 open"
        rated = store.sample_for_response("alice", replies[-1])
        assert rated is not None and rated.reward == 1.0
    finally:
        store.close()


def test_the_caps_on_open_sessions_hold_across_processes(processes):
    """Each process evicts only its own copies; the sessions beyond a user's cap, counted in the
    database, are closed once, least recent first."""
    async def scenario():
        emitted = processes.emitted
        a = processes("a", max_per_user=2)
        b = processes("b", max_per_user=2)
        for i in range(4):  # four conversations of alice's, two on each process
            await (a if i % 2 == 0 else b).turn("alice", [SYS, user(f"topic {i}")], f"answer {i}")
            await asyncio.sleep(0.01)
        await (a).turn("bob", [SYS, user("mine")], "yours")
        assert len(a.store) == 3 and len(b.store) == 2, "each process holds its own copies"
        assert sum(await asyncio.gather(a.store.sweep_shared(), b.store.sweep_shared())) == 2
        await asyncio.gather(a.store.save(), b.store.save())
        a.db.flush()
        b.db.flush()
        left = sorted((row["user"], row["pending"]["messages"][-1]["content"]) for row in a.db.load())
        assert left == [("alice", "topic 2"), ("alice", "topic 3"), ("bob", "mine")]
        return emitted

    emitted = asyncio.run(scenario())
    assert sorted(t.turn.messages[-1]["content"] for t in emitted) == ["topic 0", "topic 1"]
    assert {t.reason for t in emitted} == {"session_closed"}


def test_a_compacted_history_resumes_its_session_in_another_process(processes):
    """The resume key is indexed in the database like the line's hashes: the request after a
    compaction reaches the session whichever process served the turn before it."""
    async def scenario():
        a, b = processes("a"), processes("b")
        m1 = [SYS, user("q1")]
        first = await a.turn("alice", m1, "a1")
        await a.turn("alice", m1 + [reply("a1"), user("q2")], "a2")
        compacted = [SYS, user("The conversation history before this point was compacted: q1, a1, q2."),
                     reply("a2"), user("q3")]
        plan = await b.turn("alice", compacted, "a3")
        assert (plan.match, plan.session_id, plan.turn_index) == ("resumed", first.session_id, 3)

    asyncio.run(scenario())
