"""One object opens a process's stores (core/stores/opener.py), each on first use, and closes them."""

from __future__ import annotations

import sqlite3

import pytest

from nextstate.core.settings import Settings
from nextstate.core.stores.opener import FILES, Stores
from nextstate.core.stores.parallel_slots import LocalSlots
from nextstate.core.stores.rate_windows import MemoryWindows


async def test_stores_open_on_first_use_in_their_files_and_close_together(tmp_path):
    stores = Stores(Settings(data_dir=tmp_path))
    assert stores.opened() == [] and not list(tmp_path.glob("*.sqlite3")), "nothing is opened before it is used"
    key, secret = stores.keys.create("alice")
    assert stores.samples.samples() == []
    assert stores.opened() == ["samples", "keys"]
    assert {p.name for p in tmp_path.glob("*.sqlite3")} == {FILES["keys"], FILES["samples"]}
    # without a database URL, what only matters across processes stays in this one's memory
    assert stores.versions is None
    assert isinstance(stores.windows, MemoryWindows) and isinstance(stores.slots, LocalSlots)
    keys = stores.keys
    await stores.aclose()
    assert stores.opened() == []
    with pytest.raises(sqlite3.ProgrammingError):
        keys.verify(secret)  # closed
    assert Stores(Settings(data_dir=tmp_path)).keys.verify(secret) == key, "and the rows stay on disk"


def test_the_command_line_closes_without_a_running_loop(tmp_path):
    stores = Stores(Settings(data_dir=tmp_path))
    stores.responses.save("alice", "resp_1", [{"role": "user", "content": "hi"}])
    stores.close()
    assert stores.opened() == []
    assert Stores(Settings(data_dir=tmp_path)).responses.conversation("alice", "resp_1") == [{"role": "user", "content": "hi"}]


def test_stored_responses_keep_to_each_users_quota_the_oldest_going_first(tmp_path, database_url):
    from nextstate.core.stores.responses import ResponseStore

    store = ResponseStore(tmp_path / "responses.sqlite3", database_url, max_per_user=3, max_bytes_per_user=400)
    try:
        for i in range(5):
            store.save("alice", f"resp_{i}", [{"role": "user", "content": f"question {i}"}])
        store.save("bob", "resp_b", [{"role": "user", "content": "mine"}])
        kept = [i for i in range(5) if store.conversation("alice", f"resp_{i}") is not None]
        assert kept == [2, 3, 4] and store.conversation("bob", "resp_b") is not None, "a quota is per user"
        store.save("alice", "resp_big", [{"role": "user", "content": "x" * 350}])  # over the bytes with any other
        assert [i for i in range(5) if store.conversation("alice", f"resp_{i}") is not None] == []
        assert store.conversation("alice", "resp_big") is not None, "the newest stays, however large"
    finally:
        store.close()
