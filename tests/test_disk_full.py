"""A full disk costs no transition and no sample: they wait in memory and are written when it
has room again (core/durable.py), and serving goes on meanwhile."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

from tests.test_judge import SCRIPT, converse, judged_server


class FullDisk:
    """Makes a store's writes fail the way SQLite reports a full disk, until `free()`."""

    def __init__(self, monkeypatch, store, *methods: str) -> None:
        self.full = threading.Event()
        self.full.set()
        self.refused = 0
        for name in methods:
            monkeypatch.setattr(store, name, self._guard(getattr(store, name)))

    def _guard(self, write):
        def guarded(*args, **kwargs):
            if self.full.is_set():
                self.refused += 1
                raise sqlite3.OperationalError("database or disk is full")
            return write(*args, **kwargs)

        return guarded

    def free(self) -> None:
        self.full.clear()


def test_transitions_and_samples_made_while_the_disk_is_full_are_written_when_it_has_room(
    server_factory, judge, monkeypatch, caplog
):
    server = judged_server(server_factory, judge)
    disk = FullDisk(monkeypatch, server.app.state.services.samples, "add_transition", "add_sample")
    caplog.set_level(logging.INFO, logger="nextstate.core.durable")
    started = time.monotonic()
    converse(server.client(server.key("alice")), SCRIPT, max_tokens=3)
    server.end_conversations()
    assert time.monotonic() - started < 30, "serving must not wait for the disk"
    deadline = time.monotonic() + 10
    while disk.refused < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert disk.refused >= 3, "every transition tried the disk"
    assert server.app.state.services.samples.samples() == []
    assert any("kept in memory and retried" in r.getMessage() for r in caplog.records)

    disk.free()
    server.drain_judge()
    samples = server.app.state.services.samples.samples()
    assert sorted(s.turn_index for s in samples) == [1, 2, 3], "nothing made during the outage was lost"
    assert len({(s.session_id, s.turn_index) for s in samples}) == len(samples), "each written once"
    assert any("nothing was lost" in r.getMessage() for r in caplog.records)
