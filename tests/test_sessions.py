"""Session and turn inference: unit tests on the store, then through the HTTP API."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from nextstate.core.types import Transition, Turn
from nextstate.proxy.sessions import Session, SessionStore

SYS = {"role": "system", "content": "You are helpful."}


def user(text):
    return {"role": "user", "content": text}


def reply(text):
    return {"role": "assistant", "content": text}


def make_turn(plan, messages) -> Turn:
    return Turn(
        session_id=plan.session.id, user=plan.session.user, turn_index=plan.turn_index, messages=messages,
        prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.1], logprob_temperature=1.0, sampling={},
        policy_version=0, adapter=None, response_message={}, finish_reason="stop", created_at=0.0,
    )


class Harness:
    def __init__(self, **kwargs):
        self.now = 0.0
        self.emitted: list[Transition] = []
        self.store = SessionStore(self.emitted.append, clock=lambda: self.now, **kwargs)

    def flush(self) -> list[Transition]:
        """Close every session, so provisional next states are confirmed; all emitted so far."""
        self.store.close_all()
        return self.emitted

    def turn(self, who, messages, answer, **kwargs):
        plan = self.store.resolve(who, messages, **kwargs)
        if plan.turn_type == "main":
            self.store.commit_main(plan, make_turn(plan, messages), reply(answer))
        else:
            self.store.finish_side(plan)
        return plan


def test_continuation_is_found_without_headers_and_yields_the_next_state():
    h = Harness()
    m1 = [SYS, user("write a poem")]
    p1 = h.turn("alice", m1, "roses are red")
    assert (p1.match, p1.turn_type, p1.turn_index) == ("new", "main", 1)
    m2 = m1 + [reply("roses are red"), user("no, make it about the sea")]
    p2 = h.turn("alice", m2, "the sea is blue")
    assert p2.session is p1.session and (p2.match, p2.turn_type, p2.turn_index) == ("extend", "main", 2)
    assert h.emitted == [], "a next state is provisional until the session goes on past it"
    t, last = h.flush()
    assert t.reason == "next_state" and t.turn.turn_index == 1
    assert t.next_state.messages == [user("no, make it about the sea")]
    assert (last.reason, last.turn.turn_index, last.next_state) == ("session_closed", 2, None)


def test_tool_results_are_the_next_state():
    h = Harness()
    m1 = [user("weather?")]
    plan = h.store.resolve("alice", m1)
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "w", "arguments": {"c": 1}}}]}
    h.store.commit_main(plan, make_turn(plan, m1), call)
    # the client re-serialises arguments and picks its own id: still the same line
    echoed = {"role": "assistant", "content": None, "tool_calls": [{"id": "y", "type": "function", "function": {"name": "w", "arguments": '{"c":1}'}}]}
    results = [{"role": "tool", "tool_call_id": "y", "content": "sunny"}, {"role": "tool", "tool_call_id": "z", "content": "21C"}]
    p2 = h.turn("alice", m1 + [echoed] + results, "sunny, 21C")
    assert p2.match == "extend"
    first = h.flush()[0]
    assert [m["content"] for m in first.next_state.messages] == ["sunny", "21C"]
    assert first.next_state.role == "tool"


def test_whitespace_trimmed_by_the_client_still_matches():
    h = Harness()
    m1 = [user("hi")]
    h.turn("alice", m1, "hello there\n")
    assert h.turn("alice", m1 + [reply("hello there"), user("bye")], "bye").match == "extend"


def test_unrelated_conversation_opens_a_new_session():
    h = Harness()
    p1 = h.turn("alice", [SYS, user("a")], "A")
    p2 = h.turn("alice", [{"role": "system", "content": "Generate a title."}, user("a")], "Title")
    assert p2.session is not p1.session and p2.match == "new"
    assert h.emitted == []


def test_users_never_share_sessions():
    h = Harness()
    m1 = [SYS, user("secret plan")]
    p1 = h.turn("alice", m1, "ok")
    p2 = h.turn("bob", m1 + [reply("ok"), user("continue")], "no")
    assert p2.session is not p1.session and p2.match == "new"
    assert h.emitted == []
    # an explicit id is scoped to the user too
    pa = h.turn("alice", [user("x")], "y", session_id="shared-name")
    pb = h.turn("bob", [user("x")], "y", session_id="shared-name")
    assert pa.session is not pb.session
    assert h.store.get("alice", "shared-name") is pa.session and h.store.get("bob", "shared-name") is pb.session


def test_side_request_that_looked_like_a_continuation_is_forked_away():
    """A summarisation request extends the main line; the real next message then continues the
    line from before it. The summary turn must not be trained, and the first turn's next state
    must be the real message, not the summary instruction."""
    h = Harness()
    m1 = [SYS, user("plan my trip")]
    p1 = h.turn("alice", m1, "go to Rome")
    summary = m1 + [reply("go to Rome"), user("Summarise the conversation so far.")]
    p2 = h.turn("alice", summary, "We planned a trip.")
    real = m1 + [reply("go to Rome"), user("what about Paris?")]
    p3 = h.turn("alice", real, "Paris is nice")
    assert p3.session is p1.session and p3.match == "fork" and p3.turn_type == "main"
    assert [(t.turn.turn_index, t.reason) for t in h.emitted] == [(p2.turn_index, "superseded")]
    m4 = real + [reply("Paris is nice"), user("thanks!")]
    p4 = h.turn("alice", m4, "welcome")
    assert p4.match == "extend"
    first = h.emitted[-1]
    assert (first.turn.turn_index, first.reason) == (1, "next_state")
    assert first.next_state.messages == [user("what about Paris?")]
    confirmed = [t for t in h.flush() if t.reason == "next_state"]
    assert [(t.turn.turn_index, t.next_state.messages) for t in confirmed] == [
        (1, [user("what about Paris?")]), (p3.turn_index, [user("thanks!")])
    ]


def test_explicit_headers_override_inference():
    h = Harness()
    m1 = [user("q")]
    p1 = h.turn("alice", m1, "a", session_id="s1")
    assert p1.session.id == "s1" and p1.turn_type == "main"
    side = h.turn("alice", m1 + [reply("a"), user("title?")], "T", session_id="s1", turn_type="side")
    assert side.turn_type == "side" and h.emitted == []
    p3 = h.turn("alice", m1 + [reply("a"), user("next")], "b", session_id="s1")
    assert p3.turn_type == "main" and p3.match == "extend" and h.emitted == []
    # a request on the session that does not continue its line is a side turn
    assert h.turn("alice", [user("something else")], "c", session_id="s1").turn_type == "side"
    assert h.flush()[0].next_state.messages == [user("next")]


def test_session_done_closes_and_flushes_the_last_turn():
    h = Harness()
    plan = h.turn("alice", [user("q")], "a", done=True)
    assert plan.session.closed and len(h.store) == 0
    assert [t.reason for t in h.emitted] == ["session_closed"]
    assert h.emitted[0].next_state is None


def test_idle_sessions_close():
    h = Harness(idle_s=60)
    h.turn("alice", [user("old")], "a")
    h.now = 50
    h.turn("alice", [user("newer")], "b")
    h.now = 100
    assert h.store.sweep() == 1 and len(h.store) == 1
    assert h.emitted[0].turn.messages == [user("old")]
    h.now = 200
    assert h.store.sweep() == 1 and len(h.store) == 0


def test_memory_is_bounded_by_max_sessions():
    h = Harness(max_sessions=3)
    for i in range(10):
        h.now = i
        h.turn("alice", [user(f"conversation {i}")], "ok")
    assert len(h.store) == 3
    assert len(h.emitted) == 7 and all(t.reason == "session_closed" for t in h.emitted)
    # each open session's line: the request and our reply, and the resume key of its reply "ok",
    # one entry for all three (the newest session that gave it)
    assert len(h.store._index) == 3 * 2 + 1


def test_lookup_cost_does_not_grow_with_sessions():
    h = Harness(max_sessions=100_000)
    conv = [SYS, user("start")]
    for i in range(20_000):
        h.turn(f"user{i % 50}", [SYS, user(f"topic {i}")], "ok")
    h.turn("alice", conv, "ok")
    started = time.perf_counter()
    for _ in range(200):
        plan = h.store.resolve("alice", conv + [reply("ok"), user("more")], turn_type="side")
    per_lookup = (time.perf_counter() - started) / 200
    assert plan.match == "extend"
    assert per_lookup < 0.002


# ---------------------------------------------------------------------------- over HTTP


def test_stock_client_conversation_trains_without_headers(server, alice):
    m = [{"role": "user", "content": "Tell me a joke."}]
    r1 = alice.chat.completions.with_raw_response.create(model="tiny", messages=m, max_tokens=8)
    first = r1.parse().choices[0].message
    m += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "That was not funny."}]
    r2 = alice.chat.completions.with_raw_response.create(model="tiny", messages=m, max_tokens=8)
    assert r1.headers["x-session-id"] == r2.headers["x-session-id"]
    assert r1.headers["x-turn-type"] == r2.headers["x-turn-type"] == "main"
    second = r2.parse().choices[0].message
    m += [{"role": "assistant", "content": second.content}, {"role": "user", "content": "Another one."}]
    alice.chat.completions.create(model="tiny", messages=m, max_tokens=8)  # confirms turn 1's next state
    records = server.records()
    (transition,) = [r for r in records if r["kind"] == "transition"]
    assert transition["reason"] == "next_state" and transition["turn_index"] == 1
    assert transition["next_state"] == [{"role": "user", "content": "That was not funny."}]
    requests = [r for r in records if r["kind"] == "request"]
    assert [r["turn_index"] for r in requests] == [1, 2, 3]
    assert transition["response_tokens"] == len(requests[0]["response_ids"])


def test_headers_and_body_fields_drive_sessions(server, alice):
    m = [{"role": "user", "content": "hi"}]
    raw = alice.chat.completions.with_raw_response.create(
        model="tiny", messages=m, max_tokens=3, extra_headers={"X-Session-Id": "my-session"}
    )
    assert raw.headers["x-session-id"] == "my-session"
    side = alice.chat.completions.with_raw_response.create(
        model="tiny", messages=m, max_tokens=3, extra_body={"session_id": "my-session", "turn_type": "side"}
    )
    assert side.headers["x-turn-type"] == "side" and side.headers["x-session-id"] == "my-session"
    alice.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "bye"}], max_tokens=3,
        extra_headers={"X-Session-Id": "other", "X-Session-Done": "true"},
    )
    transitions = [r for r in server.records() if r["kind"] == "transition"]
    assert [(t["session_id"], t["reason"]) for t in transitions] == [("other", "session_closed")]


def test_bad_turn_type_header_is_400(server):
    key = server.key("alice")
    resp = httpx.post(
        f"{server.base_url}/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {key}", "X-Turn-Type": "sideways"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Turn-Type"


def test_two_users_cannot_see_each_others_sessions(server):
    alice = server.client(server.key("alice"))
    bob = server.client(server.key("bob"))
    m = [{"role": "user", "content": "my secret"}]
    a1 = alice.chat.completions.with_raw_response.create(model="tiny", messages=m, max_tokens=4, extra_headers={"X-Session-Id": "s"})
    text = a1.parse().choices[0].message.content
    follow = m + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    # bob replays alice's exact conversation, with and without her session id
    b1 = bob.chat.completions.with_raw_response.create(model="tiny", messages=follow, max_tokens=4)
    b2 = bob.chat.completions.with_raw_response.create(model="tiny", messages=follow, max_tokens=4, extra_headers={"X-Session-Id": "s"})
    assert b1.headers["x-session-id"] != "s"
    records = server.records()
    assert [r for r in records if r["kind"] == "transition"] == []  # nothing of alice's was continued
    by_user = {(r["user"], r["session_id"]) for r in records if r["kind"] == "request"}
    assert ("alice", "s") in by_user and ("bob", "s") in by_user
    assert b2.headers["x-turn-type"] == "main"
    sessions = server.app.state.services.sessions
    assert sessions.get("alice", "s") is not sessions.get("bob", "s")
    assert sessions.get("alice", "s").turn_count == 1


@pytest.mark.parametrize("idle", [0.3])
def test_idle_timeout_closes_sessions_in_the_server(server_factory, idle):
    server = server_factory(session_idle_s=idle)
    client = server.client(server.key("alice"))
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if [r for r in server.records() if r["kind"] == "transition"]:
            break
        time.sleep(0.1)
    (t,) = [r for r in server.records() if r["kind"] == "transition"]
    assert t["reason"] == "session_closed"
    assert len(server.app.state.services.sessions) == 0


# ---------------------------------------------------------------------------- agents that rewrite history


def test_an_edited_reply_continues_the_session():
    """Agents trim, merge or re-render the replies they got; the conversation is the same."""
    h = Harness()
    m1 = [SYS, user("read notes.txt")]
    p1 = h.turn("alice", m1, "I will read it.\n<tool_call>{broken")
    m2 = m1 + [reply("I will read it."), user("well?")]
    p2 = h.turn("alice", m2, "done")
    assert p2.session is p1.session and p2.match == "edited" and p2.turn_index == 2
    (t, _) = h.flush()
    assert t.edited and t.turn.turn_index == 1 and t.next_state.messages == [user("well?")]


def test_merged_attempts_and_a_deleted_retry_notice_stay_one_session():
    """OpenClaw, after a retry: its notice becomes the failed turn's next state; then it merges
    both attempts into one message and deletes the notice, and the user's next message is the
    next state of the second attempt."""
    h = Harness()
    base = [SYS, user("hi"), reply("hello"), user("read notes.txt")]
    h.turn("alice", base[:2], "hello")
    p = h.turn("alice", base, "attempt one")
    retry = user("The previous attempt did not produce a user-visible answer. Continue.")
    h.turn("alice", base + [reply("attempt one"), retry], "attempt two")
    rewritten = base + [reply("attempt one\nattempt two"), user("Use the read tool.")]
    p4 = h.turn("alice", rewritten, "ok")
    assert p4.session is p.session and p4.match == "edited"
    got = [(t.turn.turn_index, t.next_state.messages if t.next_state else None) for t in h.flush()]
    assert got == [(1, [user("read notes.txt")]), (2, [retry]), (3, [user("Use the read tool.")]), (4, None)]


def test_volatile_text_does_not_split_a_conversation():
    """Timestamps, a date line that changes at midnight, runtime lines and runtime-context
    blocks differ between requests of one OpenClaw conversation."""
    h = Harness()
    system = {"role": "system", "content": "You are OpenClaw.\nCurrent date: 2026-11-23\nTime zone: UTC"}
    first = user("[Mon 2026-11-23 23:59 UTC] hi\n\nRuntime: agent=main | session=s | model=a")
    context = user("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions: none\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
    p1 = h.turn("alice", [system, first, context], "hello")
    next_day = {"role": "system", "content": "You are OpenClaw.\nCurrent date: 2026-11-24\nTime zone: UTC"}
    later = [next_day, user("[Tue 2026-11-24 00:01 UTC] hi\n\nRuntime: agent=main | session=s | model=b"),
             reply("hello"), user("[Tue 2026-11-24 00:02 UTC] and now?"), context]
    p2 = h.turn("alice", later, "now")
    assert p2.session is p1.session and p2.match == "extend"
    (t, _) = h.flush()
    assert t.next_state.messages == [user("[Tue 2026-11-24 00:02 UTC] and now?")], "the context block is not the user"


def test_a_shared_system_prompt_alone_is_not_the_same_conversation():
    h = Harness()
    p1 = h.turn("alice", [SYS, user("first topic")], "a")
    p2 = h.turn("alice", [SYS, user("second topic")], "b")
    assert p2.session is not p1.session and p2.match == "new"
    p3 = h.turn("alice", [SYS, user("first topic"), reply("a"), user("more")], "c")
    assert p3.session is p1.session


def test_a_request_that_is_never_committed_changes_nothing():
    """An aborted or failed request: classified, never committed, leaves no trace."""
    h = Harness()
    m1 = [SYS, user("q")]
    p1 = h.turn("alice", m1, "a")
    h.store.resolve("alice", m1 + [reply("a"), user("aborted follow-up")])
    assert len(h.store) == 1 and h.emitted == [] and p1.session.turn_count == 1
    p3 = h.turn("alice", m1 + [reply("a"), user("real follow-up")], "b")
    assert p3.match == "extend" and p3.turn_index == 2
    assert h.flush()[0].next_state.messages == [user("real follow-up")]


def test_remembered_digests_are_the_digests_within_their_budget():
    from nextstate.proxy.session_chain import Chain, MessageDigests, VolatileText, message_digest

    volatile = VolatileText()
    messages = [SYS, user("[Mon 2026-11-23 09:25 UTC] hi"), reply("a1"), user("[Mon 2026-11-23 09:26 UTC] hi"),
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                      "function": {"name": "read", "arguments": '{"path": "x"}'}}]}]
    digests = MessageDigests(volatile, max_chars=40)
    for _ in range(2):  # computed, then remembered
        assert [digests(m) for m in messages] == [message_digest(m, volatile) for m in messages]
    assert Chain.of("alice", messages, digests) == Chain.of("alice", messages, MessageDigests(volatile))
    assert digests._known.total <= 40 and len(digests._known) < len(messages), "the oldest are forgotten past the budget"


def test_a_session_row_holds_each_turn_exactly(tmp_path):
    # The row is spliced from each turn's cached JSON text: after any number of requests it
    # must read back as the session it was written from, -inf logprobs included.
    store = SessionStore(lambda t: None)
    messages = [SYS, user("q1")]
    for n in range(1, 4):
        plan = store.resolve("alice", messages)
        turn = make_turn(plan, messages).model_copy(update={"response_logprobs": [float("-inf")], "response_id": f"r{n}"})
        store.commit_main(plan, turn, reply(f"a{n}"))
        s = store.get("alice", plan.session.id)
        row = json.loads(s.to_json())
        back = Session.from_json(row, 0.0)
        assert (back.pending, back.provisional, back.line.hashes) == (s.pending, s.provisional, s.line.hashes)
        assert row["pending"] == s.pending.model_dump(mode="json") | {"response_logprobs": [float("-inf")]}
        if n > 1:
            assert back.provisional.turn.response_id == f"r{n - 1}" and back.provisional.turn.response_logprobs == [float("-inf")]
        messages = messages + [reply(f"a{n}"), user(f"q{n + 1}")]
    assert len(s._encoded) == 2, "only the turns the row holds stay encoded"


def test_a_transition_on_its_way_to_the_judge_survives_a_crash(tmp_path):
    # The session's row is written beside the transition it hands over, not after it: if the
    # process dies before the judge's inbox has it, the row still does, and resume() hands it
    # over again. Once the inbox has it, the next row drops it.
    from nextstate.core.stores.sessions import SessionDB

    async def scenario():
        inbox: list[asyncio.Future] = []

        def slow_judge(transition):  # its disk write has not finished yet
            inbox.append(asyncio.get_running_loop().create_future())
            return inbox[-1]

        db = SessionDB(tmp_path / "sessions.sqlite3")
        store = SessionStore(slow_judge, db=db)
        m1 = [SYS, user("q1")]
        m2 = m1 + [reply("a1"), user("q2")]
        m3 = m2 + [reply("a2"), user("q3")]
        for messages, answer in ((m1, "a1"), (m2, "a2"), (m3, "a3")):
            plan = store.resolve("alice", messages)
            store.commit_main(plan, make_turn(plan, messages), reply(answer))
            await store.save(wait_s=0.05)
        assert len(inbox) == 1, "turn 1 was confirmed by the third request"
        db.flush()
        # the crash: the judge never got turn 1 on disk
        again: list[Transition] = []
        restarted = SessionStore(again.append, db=SessionDB(tmp_path / "sessions.sqlite3"))
        assert restarted.resume() == 1
        assert [(t.turn.turn_index, t.next_state.messages) for t in again] == [(1, [user("q2")])]

        inbox[0].set_result(None)  # in the first run, the inbox took it after all
        await asyncio.sleep(0)
        session = next(iter(store._sessions.values()))
        assert session.handing == []
        store._dirty.add((session.user, session.id))
        await store.save()
        db.flush()
        assert SessionStore(again.append, db=SessionDB(tmp_path / "sessions.sqlite3")).resume() == 0

    asyncio.run(scenario())


def test_open_sessions_survive_a_restart(tmp_path):
    from nextstate.core.stores.sessions import SessionDB

    emitted: list[Transition] = []
    db = SessionDB(tmp_path / "sessions.sqlite3")
    store = SessionStore(emitted.append, db=db)
    m1 = [SYS, user("q1")]
    plan = store.resolve("alice", m1)
    store.commit_main(plan, make_turn(plan, m1), reply("a1"))
    m2 = m1 + [reply("a1"), user("q2")]
    plan = store.resolve("alice", m2)
    store.commit_main(plan, make_turn(plan, m2), reply("a2"))
    asyncio.run(store.save())
    db.close()

    db = SessionDB(tmp_path / "sessions.sqlite3")
    restarted = SessionStore(emitted.append, db=db)
    assert len(restarted) == 1
    m3 = m2 + [reply("a2"), user("q3")]
    plan = restarted.resolve("alice", m3)
    assert plan.match == "extend" and plan.turn_index == 3 and plan.session.id == store.get("alice", plan.session.id).id
    restarted.commit_main(plan, make_turn(plan, m3), reply("a3"))
    restarted.close_all()
    asyncio.run(restarted.save())
    got = [(t.turn.turn_index, t.next_state.messages if t.next_state else None) for t in emitted]
    assert got == [(1, [user("q2")]), (2, [user("q3")]), (3, None)]
    db.close()
    assert list(SessionDB(tmp_path / "sessions.sqlite3").load()) == [], "closed sessions are gone from disk"


def test_a_rewritten_system_prompt_keeps_the_session():
    """OpenClaw retries an overflowing request with fewer tools in its system prompt."""
    h = Harness()
    m1 = [{"role": "system", "content": "Tools: read, exec, search."}, user("read notes.txt")]
    p1 = h.turn("alice", m1, "reading")
    fewer = [{"role": "system", "content": "Tools: read."}, user("read notes.txt"), reply("reading"), user("and?")]
    p2 = h.turn("alice", fewer, "done")
    assert p2.session is p1.session and p2.match == "extend"


def test_a_quiet_session_hands_over_its_last_reaction_once_and_revises_it_if_replaced():
    """A closing "thanks" has no later request to confirm it: once the session has been quiet
    for settle_s, it goes to the judge. Confirmed later, it is not sent again; replaced later
    (the user went back and reworded it), the replacement goes as a revision."""
    h = Harness(settle_s=60)
    m1 = [user("write a poem")]
    h.turn("alice", m1, "roses are red")
    m2 = m1 + [reply("roses are red"), user("thanks, lovely")]
    h.turn("alice", m2, "glad you like it")
    h.now = 30
    h.store.sweep()
    assert h.emitted == [], "not quiet long enough"
    h.now = 61
    assert h.store.sweep() == 1
    (settled,) = h.emitted
    assert settled.turn.turn_index == 1 and settled.next_state.messages == [user("thanks, lovely")]
    assert not settled.revises
    h.store.sweep()
    assert len(h.emitted) == 1, "handed over once"

    # the user rewords the reaction: a fork before our reply to it, after the settled turn's reply
    m2b = m1 + [reply("roses are red"), user("thanks, but shorter please")]
    h.turn("alice", m2b, "roses.")
    superseded, revision = h.emitted[1:]
    assert (superseded.reason, superseded.turn.turn_index) == ("superseded", 2)
    assert revision.revises and revision.turn.turn_index == 1
    assert revision.next_state.messages == [user("thanks, but shorter please")]

    # and a confirmation of a settled next state sends nothing more
    h.now = 200
    h.store.sweep()  # turn 1's revised next state was handed over already; nothing new settles
    m3 = m2b + [reply("roses."), user("perfect")]
    h.turn("alice", m3, "thanks!")
    assert len(h.emitted) == 3, "confirming what the judge has sends nothing"


def test_a_next_state_never_holds_a_reply_of_ours():
    h = Harness()
    m1 = [user("hi")]
    h.turn("alice", m1, "hello")
    m2 = m1 + [reply("hello"), user("first"), reply("an answer the agent kept"), user("second")]
    h.turn("alice", m2, "ok")
    (t, _) = h.flush()
    assert t.next_state.messages == [user("first")]


SUMMARY = user("The conversation history before this point was compacted into the following summary: q1, a1.")


def test_a_compacted_history_that_ends_with_our_last_reply_resumes_its_session(tmp_path):
    """An agent that compacts sends a summary, our last reply and the person's next message: no
    prefix is shared, the reply is. The session goes on (after a restart too), and the next
    state is what follows that reply. Another user's identical reply resumes nothing of theirs."""
    from nextstate.core.stores.sessions import SessionDB

    db = SessionDB(tmp_path / "sessions.sqlite3")
    h = Harness(db=db)
    m1 = [SYS, user("q1")]
    first = h.turn("alice", m1, "a1")
    h.turn("bob", m1, "a1")
    m2 = m1 + [reply("a1"), user("q2")]
    h.turn("alice", m2, "a2")
    asyncio.run(h.store.save())
    db.close()

    db = SessionDB(tmp_path / "sessions.sqlite3")
    h.store = SessionStore(h.emitted.append, clock=lambda: h.now, db=db)
    compacted = [SYS, SUMMARY, reply("a2"), user("q3")]
    plan = h.turn("alice", compacted, "a3")
    assert (plan.match, plan.session_id, plan.turn_index) == ("resumed", first.session_id, 3)
    again = [SYS, SUMMARY, reply("a2"), user("q3"), reply("a3"), user("q4")]
    assert h.turn("alice", again, "a4").match == "extend", "after it, the compacted history is the line"
    assert h.store.resolve("bob", [SYS, SUMMARY, reply("a2"), user("q3")]).match == "new", "bob never got a2"
    assert h.store.resolve("alice", [SYS, SUMMARY, reply("a2")]).match == "new", "the client's turn must follow"
    alice = sorted((t.turn.turn_index, t.next_state.messages if t.next_state else None)
                   for t in h.flush() if t.turn.user == "alice")
    assert alice == [(1, [user("q2")]), (2, [user("q3")]), (3, [user("q4")]), (4, None)]
    db.close()


def test_a_session_row_written_before_the_resume_key_still_extends():
    from nextstate.proxy.session_chain import Chain

    line = Chain.of("alice", [SYS, user("q1"), reply("a1")])
    old = {k: v for k, v in line.to_json().items() if k != "reply"}
    assert Chain.from_json(old).reply is None and Chain.from_json(old).keys() == line.hashes
    assert Chain.from_json(line.to_json()) == line and line.resume_key in line.keys()
