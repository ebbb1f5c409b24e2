"""A shared database that restarts or stops (issue 41): requests fail at most while it is down,
then succeed again on new connections; /readyz follows it, /healthz does not need it."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.real_engines.postgres_server import PostgresServer


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test's own: restarting it disturbs no other test."""
    server = PostgresServer()
    yield server
    server.stop()


def chat(server, key: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_a_postgres_restart_costs_only_the_restart_and_readyz_follows(server_factory, own_postgres):
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


def test_a_frozen_database_holds_up_no_request_that_does_not_need_it(server_factory, own_postgres):
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
        waiting.start()  # its key check hangs on the frozen database
        time.sleep(0.5)
        started = time.monotonic()
        assert httpx.get(f"{server.root}/healthz", timeout=30).status_code == 200
        assert time.monotonic() - started < 1.0
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
