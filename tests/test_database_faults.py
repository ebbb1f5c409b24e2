"""A shared database that restarts or stops (issue 41): requests fail at most while it is down,
then succeed again on new connections; /readyz follows it, /healthz does not need it."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.real_engines.postgres_server import PostgresServer


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test's own: restarting it disturbs no other test. Asked for
    before `server_factory`, so it stops after the server: a server stopping after its database
    waits out a connection timeout."""
    server = PostgresServer()
    yield server
    server.stop()


def chat(server, key: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_a_postgres_restart_costs_only_the_restart_and_readyz_follows(own_postgres, server_factory):
    url = own_postgres.fresh_database("restart")
    server = server_factory(database_url=url, learn=False, judge_enabled=False)
    key = server.key("alice")
    assert chat(server, key).status_code == 200
    assert httpx.get(f"{server.root}/readyz").json() == {"status": "ready"}

    own_postgres.restart()  # every connection the server held is gone
    assert chat(server, key).status_code == 200, "the first request after the restart reconnects"
    assert httpx.get(f"{server.root}/readyz").status_code == 200

    own_postgres.pause()
    try:
        down = httpx.get(f"{server.root}/readyz", timeout=30)
        assert down.status_code == 503 and "database" in down.json()["reason"]
        started = time.monotonic()
        assert httpx.get(f"{server.root}/healthz", timeout=30).status_code == 200
        assert time.monotonic() - started < 1.0, "liveness needs no database"
        assert chat(server, key).status_code >= 500, "a request that needs the database fails while it is down"
    finally:
        own_postgres.resume()
    assert chat(server, key).status_code == 200, "and succeeds once it is back"
    assert httpx.get(f"{server.root}/readyz").json() == {"status": "ready"}


def test_a_frozen_database_holds_up_no_request_that_does_not_need_it(own_postgres, server_factory):
    """PostgreSQL stopped dead (SIGSTOP: connections hang instead of failing) while a request
    waits on it: the event loop is not the one waiting, so /healthz answers at once."""
    import os
    import signal
    import threading

    server = server_factory(database_url=own_postgres.fresh_database("frozen"), learn=False, judge_enabled=False)
    key = server.key("alice")
    assert chat(server, key).status_code == 200
    os.killpg(own_postgres.process.pid, signal.SIGSTOP)
    try:
        waiting = threading.Thread(target=lambda: chat(server, key), daemon=True)
        waiting.start()  # it hangs on the frozen database (its session, its reply slot)
        time.sleep(0.5)
        started = time.monotonic()
        assert httpx.get(f"{server.root}/healthz", timeout=30).status_code == 200
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        models = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert models.status_code == 200 and time.monotonic() - started < 1.0, "a key checked lately needs no database" 
    finally:
        os.killpg(own_postgres.process.pid, signal.SIGCONT)
    waiting.join(60)
    assert chat(server, key).status_code == 200


def test_a_transaction_cut_off_by_a_restart_fails_whole_and_the_next_call_reconnects(own_postgres, tmp_path):
    """Inside a transaction a lost connection is not replaced: the rest would run alone,
    committed, on a new one. The transaction fails; the next statement outside one reconnects."""
    from nextstate.core.stores.database import Database

    db = Database.open(tmp_path / "unused", "CREATE TABLE IF NOT EXISTS t (n INTEGER)", url=own_postgres.fresh_database("tx"))
    try:
        with pytest.raises(Exception):
            with db.transaction():
                db.execute("INSERT INTO t (n) VALUES (1)")
                own_postgres.restart()
                db.execute("INSERT INTO t (n) VALUES (2)")
        assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0, "nothing of it was kept"
        db.execute("INSERT INTO t (n) VALUES (3)")
        assert [n for (n,) in db.execute("SELECT n FROM t").fetchall()] == [3]
    finally:
        db.close()


def test_a_revoke_or_forget_reaches_every_process_key_cache_within_a_second(own_postgres, tmp_path):
    """Two processes' key stores on one database, each with its cache: a key verified through
    both, then revoked (or its user forgotten) through one, stops working on the other within a
    second — the change is announced, not waited out."""
    from nextstate.core.stores.keys import KeyStore

    url = own_postgres.fresh_database("keycache")
    a, b = KeyStore(tmp_path / "a", url, cache_s=600), KeyStore(tmp_path / "b", url, cache_s=600)
    try:
        assert a._cache.wait_listening(10) and b._cache.wait_listening(10)
        for change in ("revoke", "forget"):
            key, secret = a.create(f"user-{change}")
            assert b.verify(secret) is not None and b._cache.get(hashlib_of(secret)) is not None, "cached on b"
            started = time.monotonic()
            a.revoke(key.id) if change == "revoke" else a.forget(key.user)
            while b.verify(secret) is not None:
                assert time.monotonic() - started < 1.0, f"b still takes the key after a {change}"
                time.sleep(0.01)
            assert a.verify(secret) is None
    finally:
        a.close()
        b.close()


def test_a_cached_key_is_checked_in_the_database_while_its_process_cannot_listen(own_postgres, tmp_path):
    """The listening connection lost (a restart): no cached key is trusted until it listens again."""
    from nextstate.core.stores.keys import KeyStore

    store = KeyStore(tmp_path / "k", own_postgres.fresh_database("deaf"), cache_s=600)
    try:
        assert store._cache.wait_listening(10)
        _, secret = store.create("alice")
        assert store.verify(secret) is not None and store._cache.get(hashlib_of(secret)) is not None
        own_postgres.restart()
        deadline = time.monotonic() + 10
        while store._cache.listening.is_set() and store._cache.generation < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the listener notices, drops everything, and listens again
        assert store._cache.get(hashlib_of(secret)) is None, "what was cached before the loss is gone"
        assert store.verify(secret) is not None, "checked in the database, on a new connection"
    finally:
        store.close()


def hashlib_of(secret: str) -> str:
    import hashlib

    return hashlib.sha256(secret.encode()).hexdigest()
