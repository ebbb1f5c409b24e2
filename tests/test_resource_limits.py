"""No user can stall or evict another: parallel caps, session caps, per-key rate limits, and
replies whose client has gone are stopped."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time

import httpx
import pytest

from nextstate.core.stores.opener import Stores
from tests.conftest import raw_post, scripted_factory
from tests.test_sessions import Harness, user

HELLO = [{"role": "user", "content": "hi"}]
LONG = " ".join(f"word{i}" for i in range(300))


@pytest.fixture
def slow(server_factory):
    """A server whose engine takes 50 ms per token."""

    def make(**overrides):
        factory, holder = scripted_factory(delay_s=0.05)
        server = server_factory(engine_factory=factory, **overrides)
        return server, holder["engine"]

    return make


def test_a_non_streaming_reply_stops_when_its_client_leaves(slow):
    server, engine = slow()
    engine.script(LONG)
    key = server.key("alice")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 400},
                   headers={"Authorization": f"Bearer {key}"}, timeout=0.6)
    deadline = time.monotonic() + 10
    while not [r for r in server.records() if r["kind"] == "aborted"] and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = [r for r in server.records() if r["kind"] == "aborted"]
    assert "disconnected" in record["reason"]
    assert not [r for r in server.records() if r["kind"] == "request"], "the abandoned reply was not committed"
    time.sleep(0.5)
    assert engine.generated < 100, "the engine stopped generating for nobody"
    assert raw_post(server, {"model": "tiny", "messages": HELLO, "max_tokens": 2}, key).status_code == 200


def test_a_client_that_hangs_up_mid_body_costs_one_log_line(server, caplog):
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", server.settings.server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server.key("a").encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.3)
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("client disconnected" in r.getMessage() for r in caplog.records)


def test_one_user_cannot_take_every_decoding_slot(slow):
    server, engine = slow(max_parallel_per_user=2)
    alice, bob = server.key("alice"), server.key("bob")
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 30}
    engine.default_reply = " ".join(["tok"] * 40)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(raw_post, server, body, alice) for _ in range(2)]
        time.sleep(0.3)
        third = raw_post(server, body, alice)
        started = time.monotonic()
        other = raw_post(server, body, bob)
        assert other.status_code == 200 and time.monotonic() - started < 5
        assert [f.result().status_code for f in busy] == [200, 200]
    assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_parallel_requests"
    assert third.headers["retry-after"]


def test_one_users_sessions_never_push_out_anothers():
    h = Harness(max_sessions=1000, max_per_user=50)
    h.turn("alice", [user("my conversation")], "reply")
    for i in range(60):
        h.turn("bob", [user(f"spam {i}")], "ok")
    assert h.store.get("alice", next(iter(h.store._per_user["alice"]))) is not None
    assert len(h.store._per_user["bob"]) == 50
    assert not [t for t in h.emitted if t.turn.user == "alice"], "alice's pending turn is still pending"


def test_the_global_session_cap_takes_from_the_user_holding_the_most():
    """The attack: a global cap below the per-user one (50 and 100). Bob opens 60 sessions;
    Alice's one open conversation must survive it."""
    h = Harness(max_sessions=50, max_per_user=100)
    h.turn("alice", [user("my conversation")], "reply")
    for i in range(60):
        h.turn("bob", [user(f"spam {i}")], "ok")
    assert len(h.store._per_user["alice"]) == 1 and len(h.store._sessions) == 50
    assert not [t for t in h.emitted if t.turn.user == "alice"], "alice's pending turn is still pending"


def test_session_caps_that_contradict_each_other_are_refused_at_start(tmp_path):
    from pydantic import ValidationError

    from nextstate.core.settings import ServerSettings

    with pytest.raises(ValidationError, match="NEXTSTATE_MAX_SESSIONS_PER_USER"):
        ServerSettings(max_sessions=50, max_sessions_per_user=100)
    assert ServerSettings(max_sessions=50).max_sessions_per_user == 50, "only the global cap set: the per-user one follows"


def test_per_key_request_and_token_limits(scripted):
    server, engine = scripted
    from nextstate.core.stores.keys import KeyStore

    body = {"model": "tiny", "messages": HELLO, "max_tokens": 5}
    usage = raw_post(server, body, server.key("probe")).json()["usage"]
    store = KeyStore(Stores(server.settings).path("keys"))
    try:
        _, limited = store.create("carol", rpm=2)
        # room for one reply, and then less than the next prompt
        _, frugal = store.create("dave", tpm=usage["total_tokens"] + usage["prompt_tokens"] - 1)
    finally:
        store.close()
    first = raw_post(server, body, limited)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2" and first.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw_post(server, body, limited).status_code == 200
    third = raw_post(server, body, limited)
    assert third.status_code == 429 and third.json()["error"]["type"] == "requests"
    assert third.headers["x-ratelimit-remaining-requests"] == "0" and int(third.headers["retry-after"]) >= 1
    assert raw_post(server, body, server.key("erin")).status_code == 200, "other keys are unaffected"
    spent = raw_post(server, body, frugal)
    assert spent.status_code == 200 and spent.headers["x-ratelimit-limit-tokens"] == str(usage["total_tokens"] + usage["prompt_tokens"] - 1)
    over = raw_post(server, body, frugal)
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    # a single request larger than the whole budget is never served, not even once
    store = KeyStore(Stores(server.settings).path("keys"))
    try:
        _, tiny_budget = store.create("frank", tpm=usage["prompt_tokens"] + 2)
    finally:
        store.close()
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 5}
    refused = raw_post(server, huge, tiny_budget)
    assert refused.status_code == 429 and "Request too large" in refused.json()["error"]["message"]
    too_long_a_reply = raw_post(server, {**body, "max_tokens": 50}, tiny_budget)
    assert too_long_a_reply.status_code == 429, "prompt + max_tokens are counted before the request runs"
    open_ended = raw_post(server, {"model": "tiny", "messages": HELLO}, tiny_budget)
    assert open_ended.status_code == 200 and open_ended.json()["usage"]["total_tokens"] <= usage["prompt_tokens"] + 2


def test_a_flood_of_huge_prompts_on_every_route_leaves_the_server_up_and_others_served(server):
    """The attack: one key sends 15 MB prompts (under the 16 MB body limit) to every route at
    once. Each was tokenized in full before its length was checked (+1.3 to 2.5 GiB each), and
    six in parallel got the server killed by the kernel. Now they are refused from their byte
    count alone, the server's memory stays bounded, and another user is served meanwhile."""
    import threading

    from nextstate.core.memory import resident_bytes

    mallory, alice = server.key("mallory"), server.key("alice")
    huge = "word " * 3_000_000  # 15 MB of text
    routes = {
        "/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": huge}], "max_tokens": 1},
        "/messages": {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": huge}]},
        "/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": huge}]},
        "/responses": {"model": "tiny", "input": huge, "max_output_tokens": 16},
    }
    peak, before, done = [0], resident_bytes(), threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], resident_bytes())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(routes)) as pool:
            flood = [pool.submit(httpx.post, f"{server.base_url}{path}", json=body, timeout=120,
                                 headers={"Authorization": f"Bearer {mallory}"}) for path, body in routes.items()]
            started = time.monotonic()
            served = server.client(alice).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert served.choices and time.monotonic() - started < 30, "another user is served during the flood"
            answers = [f.result() for f in flood]
    finally:
        done.set()
        watcher.join()
    for path, answer in zip(routes, answers):
        assert answer.status_code == 400, (path, answer.status_code, answer.text[:200])
        assert "maximum context length" in answer.text, path
    # the test process holds the server and the four 15 MB requests being sent
    assert peak[0] - before < 1.5 * 2**30, f"+{(peak[0] - before) / 2**30:.2f} GiB during the flood"


def test_count_tokens_counts_against_the_keys_request_limit(server):
    from nextstate.core.stores.keys import KeyStore

    store = KeyStore(Stores(server.settings).path("keys"))
    try:
        _, limited = store.create("carol", rpm=3)
    finally:
        store.close()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}
    codes = [httpx.post(f"{server.base_url}/messages/count_tokens", json=body,
                        headers={"Authorization": f"Bearer {limited}"}).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]


def test_new_work_is_refused_while_the_server_is_short_of_memory(server):
    turns = server.app.state.services.turns
    turns.max_memory_bytes = 1  # any process holds more than one byte
    try:
        refused = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.key('alice')}"},
                             json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_overloaded"
    finally:
        turns.max_memory_bytes = None


def test_shared_windows_let_through_exactly_the_limit_however_many_processes_count(tmp_path, database_url):
    """Four processes (each its own connection) counting one key at once: exactly the limit is
    let through, and a peek counts nothing."""
    import asyncio

    from nextstate.core.stores.rate_windows import SharedWindows

    if database_url is None:
        windows = [SharedWindows(tmp_path / "rates.sqlite3")]  # one process's file
    else:
        windows = [SharedWindows(tmp_path / f"{i}.sqlite3", database_url) for i in range(4)]

    async def scenario():
        assert (await windows[0].peek("k1", "requests", 10)).remaining == 10
        hits = await asyncio.gather(*(windows[i % len(windows)].hit("k1", "requests", 10) for i in range(25)))
        assert sum(h.allowed for h in hits) == 10
        assert min(h.remaining for h in hits) == 0 and all(0 < h.reset_s <= 60 for h in hits)
        assert (await windows[-1].hit("k2", "requests", 10, cost=4)).remaining == 6, "keys count apart"
        assert not (await windows[-1].peek("k2", "requests", 10, cost=7)).allowed
        assert (await windows[-1].peek("k2", "requests", 10, cost=6)).allowed

    try:
        asyncio.run(scenario())
    finally:
        for w in windows:
            w.close()


def test_a_keys_limits_hold_across_serving_processes(server_factory, postgres):
    """Two nextstate processes on one PostgreSQL: a key allowed 3 requests a minute gets 3 in
    all, not 3 from each."""
    import uuid

    url = postgres.fresh_database(f"r{uuid.uuid4().hex[:12]}")
    a, b = (server_factory(database_url=url, judge_enabled=False) for _ in range(2))
    from nextstate.core.stores.keys import KeyStore

    store = KeyStore(Stores(a.settings).path("keys"), url)
    try:
        _, limited = store.create("carol", rpm=3)
    finally:
        store.close()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
    answers = [raw_post(server, body, limited) for server in (a, b, a, b, a)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers[:3]] == ["2", "1", "0"]


def test_the_parallel_cap_holds_across_serving_processes_and_a_dead_ones_slots_expire(slow, postgres, monkeypatch):
    """Two processes on one PostgreSQL, a user capped at 2 replies at once: two running on a,
    the third is refused on b; and the slots of a process that died stop counting after their
    lease."""
    import uuid

    from nextstate.core.stores import parallel_slots

    url = postgres.fresh_database(f"p{uuid.uuid4().hex[:12]}")
    (a, engine), (b, other) = slow(max_parallel_per_user=2, database_url=url), slow(max_parallel_per_user=2, database_url=url)
    alice = a.key("alice")
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 30}
    engine.default_reply = other.default_reply = " ".join(["tok"] * 40)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(raw_post, a, body, alice) for _ in range(2)]
        time.sleep(0.5)
        third = raw_post(b, body, alice)
        assert [f.result().status_code for f in busy] == [200, 200]
    assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_parallel_requests"
    assert raw_post(b, body, alice).status_code == 200, "the slots came back when the replies ended"

    # a process that died holding two slots: they count until their lease runs out
    monkeypatch.setattr(parallel_slots, "LEASE_S", 0.5)
    dead = parallel_slots.SharedSlots(a.settings.data_dir / "unused.sqlite3", url, "dead:1")
    assert [a.call(dead.take("alice", 2)) for _ in range(3)][2] is None
    assert raw_post(b, body, alice).status_code == 429
    time.sleep(0.6)
    assert raw_post(b, body, alice).status_code == 200
    a.call(dead.aclose())
